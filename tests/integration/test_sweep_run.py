"""`vit-launch sweep` run for real (world sizes 1 and 2, CPU ranks over gloo): the windows each run
logs against what plot_scaling keeps, what the sweep does with a size that fails and with Ctrl-C,
and what it settles before the first job as `vit-launch run` does (a busy rendezvous port, the
store's variables for pdsh nodes)."""
import json
import os
import signal
import subprocess
import sys

import pytest
from dist_utils import REPO, TINY_MODEL, free_port, group_alive, job_env, run_job, wait_for

pytestmark = pytest.mark.slow

CONFIG = "configs/tiny_cpu.yaml"
SMALL = [f"model.name={TINY_MODEL}", "train.micro_batch_size=8", "data.workers=0", "logging.wandb.mode=disabled"]
# five phases in 10 steps: with a window every 2 steps, every window would be a phase's first (cold)
SCHEDULE = "train.resolution_schedule=[[0.0, 32], [0.2, 48], [0.4, 64], [0.6, 32], [0.8, 64]]"


def test_a_sweep_measures_warm_windows_and_records_a_failed_size(shards, tmp_path):
    root = tmp_path / "sweep"
    r = run_job([sys.executable, "-m", "launch", "sweep", "--config", CONFIG, "--world-sizes", "1,2", "--steps", "10",
                 "--output-root", str(root), "--group", "g", "--master-port", str(free_port()),
                 f"data.train_shards={shards}", *SMALL, SCHEDULE],
                VITSCALE_FAULT="crash_in_step:2@1")  # rank 1 exists only at world size 2
    out = r.stdout
    assert r.returncode == 1, out[-3000:] + r.stderr[-3000:]  # a size failed: the sweep says so
    records = [json.loads(line) for line in (root / "ws1" / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for rec in records if rec["cold_steps"] == 0) >= 4, records
    table = out[out.index("world  runs"):].splitlines()
    assert table[1].split()[:2] == ["1", "1"] and not table[2].startswith("    2")  # size 1 measured, 2 not
    assert "world size 2: not measured: failed with exit code" in out
    doc = json.loads((root / "sweep.json").read_text())
    assert doc["runs"][0]["exit_code"] == 0 and doc["runs"][1]["exit_code"] not in (0, None)
    assert [row["world_size"] for row in doc["table"]] == [1]


def test_ctrl_c_stops_the_sweep_not_only_the_size_it_runs(shards, tmp_path):
    """Ctrl-C reaches the sweep (the terminal's foreground group): the size running checkpoints and
    stops, and no later size starts; the sweep exits 75, as `vit-launch run` does."""
    root = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "launch", "sweep", "--config", CONFIG, "--world-sizes", "1,2", "--steps", "2000",
           "--output-root", str(root), "--group", "g", "--master-port", str(free_port()),
           f"data.train_shards={shards}", *SMALL]
    log = tmp_path / "sweep.log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: (root / "ws1" / "metrics.jsonl").is_file(), 120, proc, "the first size's first window")
        os.kill(proc.pid, signal.SIGINT)  # the sweep alone: the jobs run in sessions of their own
        code = proc.wait(timeout=120)
        wait_for(lambda: not group_alive(proc), 30, None, "the sweep's processes to end")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 75, text[-3000:]
    assert not (root / "ws2").exists() and "==> world size 2" not in text, text[-3000:]
    # each size starts over (checkpoint.resume=false): no line promises the same command resumes it
    assert "vit-launch: the job stopped after a checkpoint (exit 75)\n" in text, text[-3000:]
    assert "no later size starts (run again, a sweep measures every size from the start)" in text, text[-3000:]
    doc = json.loads((root / "sweep.json").read_text())
    assert [r["exit_code"] for r in doc["runs"]] == [75, None]
    assert (root / "ws1" / "checkpoints" / "latest").is_file()  # the stop checkpoint


def test_a_busy_rendezvous_port_is_one_line_before_any_job(shards, tmp_path):
    """As `vit-launch run` refuses it: every size's ranks would otherwise stall at the rendezvous."""
    import socket

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_job([sys.executable, "-m", "launch", "sweep", "--config", CONFIG, "--world-sizes", "1", "--steps", "5",
                     "--output-root", str(tmp_path / "sweep"), "--master-port", str(port),
                     f"data.train_shards={shards}", *SMALL], timeout=120)
    assert r.returncode == 2 and "==> world size" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"vit-launch: error: --master-port {port} is in use on this machine "
                                             "(another job's rendezvous?); choose a free one with --master-port"]


def test_store_location_reaches_every_node_of_a_hostfile_sweep(shards, tmp_path):
    """Every size of a hostfile sweep starts over pdsh, which forwards only NCCL*/PYTHON*/UCX*/MV2*:
    the S3 store's location goes through DS_ENV_FILE, as `vit-launch run` writes it. (Whether the
    job starts depends on ssh to 127.0.0.1 here; the cluster tier runs pdsh jobs for real.)"""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=1\n")
    root = tmp_path / "sweep"
    r = run_job([sys.executable, "-m", "launch", "sweep", "--config", CONFIG, "--world-sizes", "1", "--steps", "5",
                 "--output-root", str(root), "--hostfile", str(hosts), "--master-port", str(free_port()),
                 f"data.train_shards={shards}", *SMALL], timeout=300,
                AWS_ENDPOINT_URL="http://127.0.0.1:9", DS_ENV_FILE=str(tmp_path / "none"))
    env_file = root / "deepspeed_env"
    assert f"AWS_ENDPOINT_URL to every node through DS_ENV_FILE={env_file}" in r.stdout, r.stdout[-2000:]
    assert env_file.read_text() == "AWS_ENDPOINT_URL=http://127.0.0.1:9\n"
