"""`vit-launch sweep --dry-run`: the plan of a scaling sweep. Every planned command is parsed back
by DeepSpeed's runner and its overrides by our config loader, so what is checked is what the
jobs would really receive."""
import json
import os
import shlex

import pytest
from deepspeed.launcher.runner import parse_args as runner_parse_args

from launch import sweep
from launch.cli import main
from launch.hostfile import local_gpu_count
from pretrain.config import load_config

CONFIG = "configs/tiny_cpu.yaml"  # micro batch 32, global 64, W&B project vitscale-demo


def plan(capsys, tmp_path, *argv):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--output-root", str(tmp_path / "sweep"), "--group", "g1",
              "--dry-run", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    cmds = [shlex.split(line.strip()[2:]) for line in out.splitlines() if line.strip().startswith("$ ")]
    runs = []
    for cmd in cmds:
        a = runner_parse_args(cmd[1:])
        assert a.user_script == "pretrain.train" and a.user_args[:2] == ["--config", CONFIG]
        runs.append((a, load_config(CONFIG, a.user_args[2:])))
    return out, runs


def test_weak_scaling_plan(capsys, tmp_path):
    out, runs = plan(capsys, tmp_path, "--world-sizes", "4,1,2", "--gpus-per-node", "4", "--steps", "20",
                     "optim.lr=2e-3")
    assert "weak scaling (micro batch 32 per rank, global batch = 32 x world size)" in out
    assert [a.num_gpus for a, _ in runs] == [1, 2, 4]  # sorted, one local node
    for (a, cfg), n in zip(runs, (1, 2, 4)):
        assert cfg.train.micro_batch_size == 32 and cfg.train.global_batch_size == 32 * n
        assert cfg.train.output_dir == str(tmp_path / "sweep" / f"ws{n}")  # one folder per size
        w = cfg.logging.wandb
        assert (w.group, w.name, w.project) == ("g1", f"g1-ws{n}", "vitscale-demo")  # shared group
        assert w.tags == ["scaling", "scaling=weak", f"world_size={n}"]
        assert cfg.train.steps == 20 and cfg.train.log_every_steps == 4  # 5 windows: 4 left after warm-up
        assert cfg.checkpoint.resume is False  # a measurement never resumes an earlier run
        assert cfg.optim.lr == 2e-3  # the user's overrides reach every run


def test_strong_scaling_keeps_the_global_batch(capsys, tmp_path):
    _, runs = plan(capsys, tmp_path, "--world-sizes", "1,2", "--scaling", "strong", "train.micro_batch_size=16")
    assert [(cfg.train.global_batch_size, cfg.train.micro_batch_size) for _, cfg in runs] == [(64, 16), (64, 16)]
    assert runs[0][1].logging.wandb.tags[-2:] == ["scaling=strong", "world_size=1"]


def test_strong_scaling_that_cannot_divide_is_a_one_line_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--world-sizes", "1,4", "--scaling", "strong", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert ("strong scaling: train.global_batch_size=64 is not divisible by "
            "train.micro_batch_size x world size = 32 x 4") in err[0]


@pytest.mark.parametrize("argv, said", [
    (["--gpus-per-node", "0"], "--gpus-per-node must be a positive number, got 0"),
    (["--master-port", "70000"], "--master-port must be in 1-65535, got 70000"),
])
def test_rank_options_out_of_range_are_refused_as_run_refuses_them(capsys, argv, said):
    """A sweep's --gpus-per-node 0 was read as "the default" (this machine's GPUs) and planned."""
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--world-sizes", "1,2", "--dry-run", *argv])
    assert (e.value.code, capsys.readouterr().err) == (2, f"vit-launch: error: {said}\n")


def test_multi_node_sizes_use_whole_nodes_of_the_hostfile(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("n0 slots=8\nn1 slots=8\n")
    _, runs = plan(capsys, tmp_path, "--world-sizes", "4,8,16", "--hostfile", str(hosts))
    assert [(a.hostfile, a.num_nodes, a.num_gpus) for a, _ in runs] == [
        (str(hosts), 1, 4), (str(hosts), 1, 8), (str(hosts), 2, 8)]
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--world-sizes", "12", "--hostfile", str(hosts), "--dry-run"])
    assert e.value.code == 2
    assert "world size 12 is not a whole number of nodes of 8 GPUs" in capsys.readouterr().err


def test_user_log_interval_is_kept(capsys, tmp_path):
    _, runs = plan(capsys, tmp_path, "--world-sizes", "1", "train.log_every_steps=5")
    assert runs[0][1].train.log_every_steps == 5


def test_tags_from_the_config_are_kept(capsys, tmp_path):
    _, runs = plan(capsys, tmp_path, "--world-sizes", "2", f"logging.wandb.tags={json.dumps(['ablation'])}")
    assert runs[0][1].logging.wandb.tags == ["ablation", "scaling", "scaling=weak", "world_size=2"]


@pytest.mark.skipif(local_gpu_count() > 0, reason="GPU ranks do not share CPU threads")
def test_cpu_ranks_get_equal_threads_at_every_size(monkeypatch, tmp_path):
    """Weak scaling on CPU compares like with like: every rank of every size gets cores / max N."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = load_config(CONFIG)
    p = sweep.plan(cfg, CONFIG, [], [1, 2], root=str(tmp_path), group="g")
    env = sweep.cpu_thread_env(p, hostfile=None)
    assert env["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert sweep.cpu_thread_env(p, hostfile=None) is None
