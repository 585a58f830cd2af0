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
from pretrain.config import check_world_size, load_config

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
    assert "weak scaling (32 images per rank and step, global batch = 32 x world size)" in out
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
    out, runs = plan(capsys, tmp_path, "--world-sizes", "1,2", "--scaling", "strong", "train.micro_batch_size=16")
    assert [(cfg.train.global_batch_size, cfg.train.micro_batch_size) for _, cfg in runs] == [(64, 16), (64, 16)]
    # a rank's images per step are 64 at size 1 and 32 at size 2, never the micro batch of 16
    assert "strong scaling (global batch 64 at every size, split over the ranks in micro batches of 16)" in out
    assert "images per rank and step" not in out
    assert runs[0][1].logging.wandb.tags[-2:] == ["scaling=strong", "world_size=1"]


SCHEDULE = "train.resolution_schedule=[[0.0, 32, 64], [0.5, 64]]"  # 32 px at micro 64, then 64 px at micro 32


def test_weak_scaling_splits_every_schedule_phase_alike(capsys, tmp_path):
    """A phase's own micro batch (64) did not divide the weak global batch (32 x N): every size was
    refused by the config's own batch check."""
    out, runs = plan(capsys, tmp_path, "--world-sizes", "1,2", SCHEDULE)
    assert "global batch = 64 x world size" in out
    for (_, cfg), n in zip(runs, (1, 2)):
        assert cfg.train.global_batch_size == 64 * n
        assert check_world_size(cfg.train, n) == 2  # micro 32: 2 accumulation steps at every size


def test_strong_scaling_names_a_global_batch_every_size_divides(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--world-sizes", "2,3", "--scaling", "strong", "--dry-run",
              "train.micro_batch_size=16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert "= 16 x 3; choose a global batch divisible by 96 (every size of the sweep)" in err[0]  # not 48
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--world-sizes", "1,2", "--scaling", "strong", "--dry-run", SCHEDULE])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert ("train.global_batch_size=64 is not divisible by the micro batch every train.resolution_schedule "
            "phase divides x world size = 64 x 2; choose a global batch divisible by 128") in err[0]


def warm_windows(cfg) -> int:
    """Logging windows of the run that hold no first step (of the run or of a schedule phase): those
    plot_scaling keeps. Counted here from the config alone, as the training loop cuts its windows."""
    t = cfg.train
    starts = {1} | {round(e[0] * t.steps) + 1 for e in t.resolution_schedule}
    ends = {s - 1 for s in starts} | {t.steps}
    warm, first = 0, 1
    for step in range(1, t.steps + 1):
        if step % t.log_every_steps == 0 or step in ends:
            warm += first not in starts
            first = step + 1
    return warm


@pytest.mark.parametrize("steps, schedule", [
    (50, []), (20, []), (7, []),
    (20, [[0.0, 32], [0.2, 48], [0.4, 64], [0.6, 32], [0.8, 64]]),  # every 4-step window was a phase's first
    (50, [[0.0, 32], [0.2, 48], [0.4, 64], [0.6, 32], [0.8, 64]]),
    (10, [[0.0, 32], [0.2, 48], [0.4, 64], [0.6, 32], [0.8, 64]]),
])
def test_log_window_leaves_windows_after_the_cold_ones(capsys, tmp_path, steps, schedule):
    _, runs = plan(capsys, tmp_path, "--world-sizes", "1", "--steps", str(steps),
                   f"train.resolution_schedule={json.dumps(schedule)}")
    assert warm_windows(runs[0][1]) >= min(4, steps - 1 - max(0, len(schedule) - 1))


@pytest.mark.parametrize("argv, said", [
    (["--steps", "1"], "--steps 1 leaves no logged window to measure: the first window of the run is warm-up, "
                       "dropped by plot_scaling; use --steps 5 or more"),
    (["--steps", "5", "train.resolution_schedule=[[0.0, 32], [0.2, 48], [0.4, 64], [0.6, 32], [0.8, 64]]"],
     "--steps 5 leaves no logged window to measure: the first window of the run and of each "
     "train.resolution_schedule phase is warm-up"),
    (["--steps", "10", "train.log_every_steps=10"], "train.log_every_steps=10 leaves no logged window of --steps 10"),
])
def test_a_run_left_with_nothing_to_measure_is_refused_before_any_job(capsys, argv, said):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--world-sizes", "1,2", "--dry-run", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and said in err, err


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
    # one node of the hostfile: the runner's local path would run it on the machine running the
    # sweep, not on n0; forced over pdsh as the two-node size is
    assert [a.force_multi for a, _ in runs] == [True, True, False]
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


@pytest.mark.parametrize("plot, said", [
    ("scaling.txt", "--plot {}: extension .txt"),
    ("", "argument --plot: empty"),
])
def test_a_plot_that_cannot_be_written_is_refused_before_any_run(capsys, tmp_path, plot, said):
    """The plot is drawn after the last size has run: a bad --plot must stop the sweep first."""
    where = str(tmp_path / plot) if plot else ""
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", CONFIG, "--world-sizes", "1,2", "--dry-run", "--plot", where])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and said.format(where) in err[0], err
