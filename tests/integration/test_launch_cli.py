"""`vit-launch --dry-run`: the printed command is exactly what DeepSpeed's runner will parse, for
local, hostfile and multi-node cases; user mistakes are one line on stderr with exit code 2."""
import shlex
import subprocess
import sys

import pytest
from deepspeed.launcher.runner import parse_args as runner_parse_args

from launch.cli import main

CONFIG = "configs/tiny_cpu.yaml"


def dry_run(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(["--config", CONFIG, "--dry-run", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # the command and nothing else: it can be piped or pasted
    return shlex.split(lines[0])


def user_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vit-launch"), err
    return lines[0]


@pytest.fixture()
def hostfile(tmp_path):
    p = tmp_path / "hosts"
    p.write_text("node-a slots=8\nnode-b slots=8\nnode-c slots=8\n")
    return str(p)


def test_local_dry_run_is_the_runner_command(capsys):
    cmd = dry_run(capsys, "--gpus-per-node", "2", "optim.lr=3e-4", "data.train_shards=/data/my shards/manifest.json")
    assert cmd[0].endswith("deepspeed")
    a = runner_parse_args(cmd[1:])
    assert (a.num_gpus, a.num_nodes, a.hostfile.endswith("hostfile")) == (2, -1, True)  # runner default path
    assert a.module and a.user_script == "pretrain.train"
    # the space inside an override survives the shell quoting as one argument
    assert a.user_args == ["--config", CONFIG, "optim.lr=3e-4", "data.train_shards=/data/my shards/manifest.json"]


def test_multi_node_dry_run(capsys, hostfile):
    cmd = dry_run(capsys, "--hostfile", hostfile, "--num-nodes", "2", "--gpus-per-node", "4",
                  "--master-addr", "10.0.0.1", "--master-port", "29600")
    a = runner_parse_args(cmd[1:])
    assert (a.hostfile, a.num_nodes, a.num_gpus, a.master_addr, a.master_port) == (hostfile, 2, 4, "10.0.0.1", 29600)
    assert a.user_script == "pretrain.train" and a.user_args == ["--config", CONFIG]


def test_hostfile_without_counts_uses_every_slot(capsys, hostfile):
    a = runner_parse_args(dry_run(capsys, "--hostfile", hostfile)[1:])
    assert (a.num_nodes, a.num_gpus) == (-1, -1)  # the runner takes the whole hostfile, as pre-flight does


def test_include_is_passed_through(capsys, hostfile):
    a = runner_parse_args(dry_run(capsys, "--hostfile", hostfile, "--include", "node-a@node-c:0,1")[1:])
    assert a.include == "node-a@node-c:0,1" and a.num_gpus == -1


def test_bad_hostfile_line_is_one_line(capsys, tmp_path):
    p = tmp_path / "hosts"
    p.write_text("node-a slots=8\nnode-b slots=x\n")
    line = user_error(capsys, ["--config", CONFIG, "--hostfile", str(p), "--dry-run"])
    assert f"{p}:2: slots must be a whole number" in line


@pytest.mark.parametrize("command", [["run", "--dry-run"], ["check"]])
def test_a_hostfile_that_is_not_text_is_one_line(capsys, tmp_path, command):
    """A hostfile saved in another encoding (or a binary picked by mistake): `run` and `check` say
    which file and line, not a UnicodeDecodeError's traceback."""
    p = tmp_path / "hosts"
    p.write_bytes(b"node-a slots=8\nn\xe9ud-b slots=8\n")  # "néud" in Latin-1
    line = user_error(capsys, [*command[:1], "--config", CONFIG, "--hostfile", str(p), *command[1:]])
    assert f"{p}:2: not UTF-8 text (byte 0xe9)" in line


@pytest.mark.parametrize("argv, needle", [
    (["--config", CONFIG, "--dry-run", "optim.lrr=1"], "unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
    (["--config", "configs/nope.yaml", "--dry-run"], "configs/nope.yaml: config file not found"),
    (["--config", CONFIG, "--dry-run", "--num-nodes", "2"], "--num-nodes 2 needs --hostfile"),
    (["--config", CONFIG, "--dry-run", "--gpus-per-node", "0"], "--gpus-per-node must be a positive number"),
    (["--config", CONFIG, "--dry-run", "--bogus"], "unrecognized arguments: --bogus"),
    (["slurm", "--config", CONFIG, "--nodes", "2", "--gpus-per-node", "8", "--time", "4h",
      "--output", "x.sbatch"], "--time '4h': use a SLURM time"),
    (["sweep", "--config", CONFIG, "--world-sizes", "1,two", "--dry-run"], "--world-sizes '1,two'"),
])
def test_user_mistakes(capsys, argv, needle):
    assert needle in user_error(capsys, argv)


NOPE = ["--config", "configs/nope.yaml"]  # read, it would be the error: the argument check comes first


@pytest.mark.parametrize("argv, needle", [
    ([*NOPE, "--dry-run", "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    ([*NOPE, "--dry-run", "--stop-grace", "nan"], "--stop-grace must be a number of seconds > 0, got nan"),
    ([*NOPE, "--dry-run", "--stop-grace", "0"], "--stop-grace must be a number of seconds > 0, got 0"),
    ([*NOPE, "--dry-run", "--restart-backoff", "inf"], "--restart-backoff must be a number of seconds >= 0, got inf"),
    (["check", *NOPE, "--world-size", "2", "--master-port", "99999"], "--master-port must be in 1-65535, got 99999"),
    (["plan", "--model", "vit_base_patch16_224", "--gpu", "h100-sxm", "--img-size", "0"],
     "--img-size 0: must be a positive number of pixels"),
    ([*NOPE, "--dry-run", "--min-nodes", "2"], "--min-nodes needs --hostfile and a positive number"),
    (["check", *NOPE, "--world-size", "2", "--gpu", "Z80"], "--gpu 'Z80' is not one of"),
    (["sweep", *NOPE, "--world-sizes", "2", "--steps", "0"], "--steps must be positive"),
    (["slurm", *NOPE, "--nodes", "1", "--gpus-per-node", "1", "--parts", "2", "--output", "x.sbatch"],
     "--parts belongs to a shard-writing job array"),
    (["plan", "--gpu", "h100-sxm"], "give --model NAME or --config FILE"),
])
def test_argument_values_are_checked_before_any_work(capsys, argv, needle):
    """A bad value is the one line: no config read, no command printed, no pre-flight run."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert (e.value.code, out) == (2, "") and len(err.strip().splitlines()) == 1, (out, err)
    assert err.startswith(f"vit-launch: error: {needle}"), err


@pytest.mark.parametrize("argv, needle", [
    (["--model", "vit_base_patch16_224", "--img-size", "100"],
     "--img-size 100: must be a positive multiple of vit_base_patch16_224's patch size 16"),
    (["--config", CONFIG, "--img-size", "72", "--world-size", "2"],
     "--img-size 72: must be a positive multiple of vit_tiny_patch16_224's patch size 16"),
    (["--config", CONFIG, "--world-size", "2", "--nodes", "4"],
     "--world-size 2 is 1 node(s) of 2 GPUs, not --nodes 4: give one of the two"),
    (["--model", "vit_base_patch16_224", "--world-size", "32", "--nodes", "2"],
     "--world-size 32 is 4 node(s) of 8 GPUs, not --nodes 2"),
    # the config's batch on the default world (one node of 8): in the config's keys, and where 8 came from
    (["--config", CONFIG], "train.global_batch_size=64 is not divisible by train.micro_batch_size x world size = "
                           "32 x 8 = 256; e.g. train.micro_batch_size=8 or train.global_batch_size=256 (world size "
                           "8: one node of --gpus-per-node 8; give --world-size or --nodes)"),
])
def test_plan_refuses_a_layout_it_would_have_read_otherwise(capsys, argv, needle):
    """`plan --img-size 0` meant the default and 100 px was priced on a patch-16 model; `--world-size`
    silently won over `--nodes`: each is one line now, after the config is read (the model's patch)."""
    assert needle in user_error(capsys, ["plan", "--gpu", "h100-sxm", *argv])


def test_plan_takes_the_world_size_with_a_model_too(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--gpu", "h100-sxm", "--model", "vit_base_patch16_224", "--world-size", "16", "--json"])
    out, err = capsys.readouterr()
    import json

    doc = json.loads(out)
    assert e.value.code == 0 and (doc["layout"]["nodes"], doc["layout"]["gpus_per_node"]) == (2, 8), err


def test_plan_of_a_model_prices_the_buckets_training_picks(capsys, tmp_path):
    """`plan --model` without a config prices the layout a config of the defaults trains with:
    zero.reduce_bucket_size and zero.stage3_prefetch_bucket_size are auto there, not DeepSpeed's
    5e8 / 5e7, so the ZeRO-2 reduction overlaps the backward as it will in training."""
    import json

    def plan(*argv):
        with pytest.raises(SystemExit) as e:
            main(["plan", "--gpu", "h100-sxm", "--nodes", "8", "--json", *argv])
        out, err = capsys.readouterr()
        assert e.value.code == 0, err
        return json.loads(out)

    by_model = plan("--model", "vit_large_patch16_224", "--zero", "2")
    cfg = tmp_path / "l16.yaml"
    from pathlib import Path

    cfg.write_text(f"base: {Path('configs/vit_l16_in21k.yaml').resolve()}\nmodel: {{num_classes: 1000}}\n"
                   "train: {activation_checkpointing: false, compile: false}\ndata: {multi_label: false}\n")
    by_config = plan("--config", str(cfg), "--micro-batch", "32", "--global-batch", "2048")
    for key in ("reduce_bucket_size", "prefetch_bucket_size"):
        assert by_model["layout"][key] == by_config["layout"][key] < 100_000_000, (key, by_model["layout"])
    assert by_model["exposed_comm_seconds"] < 0.5 * by_model["comm_seconds"], by_model


def test_python_dash_m_launch_has_no_traceback(tmp_path):
    """The real entry point in a fresh process: a bad key is one stderr line, exit 2."""
    r = subprocess.run([sys.executable, "-m", "launch", "--config", CONFIG, "--dry-run", "train.stepz=3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "vit-launch: error: command line: unknown key 'train.stepz'; did you mean 'train.steps'?"]


def test_help_lists_the_commands_and_each_has_its_own_description(capsys):
    from launch.cli import COMMANDS

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    listed = out[out.index("commands:"):].splitlines()[1:len(COMMANDS) + 1]
    assert [x.split()[0] for x in listed] == list(COMMANDS)  # one line each, in order
    assert all(len(x.split()) > 4 for x in listed)
    seen = set()
    for cmd in list(COMMANDS)[1:]:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert e.value.code == 0 and text.startswith(f"usage: vit-launch {cmd} ")
        assert " ".join(COMMANDS[cmd].DESCRIPTION.split()) in text and "commands:" not in text
        seen.add(COMMANDS[cmd].DESCRIPTION)
    assert len(seen | {COMMANDS["run"].DESCRIPTION}) == len(COMMANDS)


def test_exclude_slow_hosts_starts_on_the_hostfile_less_the_named_hosts(capsys, hostfile, tmp_path):
    """The run named node-b a straggler: the next start leaves it out and writes the hostfile it
    used, node-b's line a comment saying why; without a record the hostfile is used whole. A start
    whose batch cannot be split over the nodes left is one line."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    args = ["--config", CONFIG, "--dry-run", "--exclude-slow-hosts", "--hostfile", hostfile, f"train.output_dir={run}",
            "train.global_batch_size=1536"]  # micro 32 x 24 ranks x 2 steps, or x 16 ranks x 3
    with pytest.raises(SystemExit) as e:
        main(args)
    out, _ = capsys.readouterr()
    assert e.value.code == 0 and (run / "hostfile.used").read_text() == open(hostfile).read()
    (run / "stragglers.json").write_text(json.dumps({"ranks": [9], "hosts": ["node-b"], "line": "rank 9 ..."}))
    with pytest.raises(SystemExit) as e:
        main(args)
    out, _ = capsys.readouterr()
    assert e.value.code == 0
    assert "vit-launch: leaving out node-b: slow: rank 9 ... (stragglers.json)" in out
    assert "vit-launch: starting on 2 node(s), 16 rank(s): node-a, node-c" in out
    cmd = shlex.split(out.strip().splitlines()[-1].lstrip("$ "))
    assert cmd[cmd.index("--hostfile") + 1] == str(run / "hostfile.used")
    assert (run / "hostfile.used").read_text() == ("node-a slots=8\nnode-c slots=8\n"
                                                   "# node-b slots=8  left out: slow: rank 9 ... (stragglers.json)\n")
    runner_parse_args(cmd[1:])  # DeepSpeed's runner takes it
    from deepspeed.launcher.runner import fetch_hostfile

    assert list(fetch_hostfile(str(run / "hostfile.used"))) == ["node-a", "node-c"]  # and reads it so
    assert ("without node-b: 2 node(s), 16 rank(s) left, and train.global_batch_size=768 is not divisible by "
            "train.micro_batch_size x world size = 32 x 16") in user_error(
        capsys, args[:-1] + ["train.global_batch_size=768"])
    assert "--exclude-slow-hosts needs --hostfile" in user_error(
        capsys, ["--config", CONFIG, "--exclude-slow-hosts", "--skip-checks", f"train.output_dir={run}"])
    assert "below --min-nodes 3" in user_error(capsys, args + ["--min-nodes", "3"])


def test_a_busy_master_port_is_one_line_before_launch(capsys, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        line = user_error(capsys, ["--config", CONFIG, "--skip-checks", "--master-port", str(port),
                                   f"train.output_dir={tmp_path}"])
    assert f"--master-port {port} is in use on this machine" in line
