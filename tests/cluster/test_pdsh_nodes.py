"""Two "nodes" on loopback addresses through the stock deepspeed runner's pdsh backend over a real
sshd: train to the end; then kill -9 the rank on the second node and require every process of the
job to be gone within the bound (120 s on gloo); start again: it resumes from the last
complete checkpoint and finishes.

The runner is given ``--no_ssh_check``: its pre-launch check runs plain ``ssh HOST hostname``,
which reads only ``~/.ssh/config`` (the tests never touch it); pdsh's own ssh calls use our
config through ``PDSH_SSH_ARGS_APPEND=-F ...``.
"""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, descendants, ds_env_file, kill_pids, procs, train_overrides, wait_until
from dist_utils import free_port

from launch.runner import deepspeed_executable
from pretrain.checkpointing import checkpoint

pytestmark = pytest.mark.cluster

DEAD_RANK_BOUND_S = 120  # a dead rank ends the whole job within this on gloo


def runner_cmd(nodes, *extra):
    return [deepspeed_executable(), "--hostfile", str(nodes.hostfile), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "--no_ssh_check", "--module", "pretrain.train",
            "--config", "configs/tiny_cpu.yaml", *extra]


def start(nodes, shards, run_dir, log, tmp_path, *overrides):
    env_file = ds_env_file(tmp_path / f"deepspeed_env.{log.stem}")
    env = {**os.environ, **nodes.env, "DS_ENV_FILE": str(env_file), "PYTHONUNBUFFERED": "1",
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.pop("VITSCALE_FAULT", None)
    cmd = runner_cmd(nodes, *train_overrides(shards, run_dir, *overrides))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def job_pids(runner: subprocess.Popen, nodes, run_dir) -> set[int]:
    """Every process of the job: the runner's session (runner, pdsh, ssh clients), what our sshd
    started for it (login shells, launchers, ranks, DataLoader workers), and anything else whose
    command line names the job's run folder (a rank or worker that lost its parents)."""
    table = procs()
    pids = {pid for pid, (_, sid, cmd) in table.items() if sid == runner.pid or str(run_dir) in cmd}
    pids |= descendants(nodes.daemon.pid, table)
    pids.discard(nodes.daemon.pid)
    return pids


def describe(pids) -> str:
    table = procs()
    return "\n".join(f"  {p} ppid={table[p][0]} {table[p][2][:160]}" for p in sorted(pids) if p in table)


@pytest.fixture
def job(ssh_nodes, demo_manifest):
    """Start jobs; at teardown SIGKILL whatever of theirs is left (by PID), even on failure."""
    started = []

    def run(run_dir, log, tmp_path, *overrides):
        p = start(ssh_nodes, demo_manifest, run_dir, log, tmp_path, *overrides)
        started.append((p, run_dir))
        return p

    yield run
    for p, run_dir in started:
        kill_pids(job_pids(p, ssh_nodes, run_dir))
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def steps_logged(run_dir) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()),
                   default=0)
    except (OSError, ValueError):
        return 0


def finished(p: subprocess.Popen, log: Path, timeout: float, what: str) -> str:
    """Waits for a job that must succeed; its log's text (the test fails with the log's tail if
    it runs past ``timeout`` or exits non-zero)."""
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} still running after {timeout:g} s:\n{log.read_text()[-4000:]}")
    out = log.read_text()
    assert p.returncode == 0, out[-4000:]
    return out


def test_two_loopback_nodes_train_to_the_end(ssh_nodes, job, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "smoke.log"
    out = finished(job(run_dir, log, tmp_path, "train.steps=10", "checkpoint.every_steps=10"), log, 300, "2-node job")
    # one launcher per node, started over pdsh (the runner's log names both workers)
    assert "127.0.0.1" in out and "127.0.0.2" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 10, summary
    assert checkpoint.latest_complete(run_dir / "checkpoints").name == "step_00000010"
    config = (run_dir / "config.yaml").read_text()
    assert str(run_dir) in config


def test_kill_rank_on_second_node_ends_job_then_resume(ssh_nodes, job, tmp_path):
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    steps = 60
    common = (f"train.steps={steps}", "checkpoint.every_steps=5", "checkpoint.keep_last=3")
    log = tmp_path / "first.log"
    p = job(run_dir, log, tmp_path, *common)

    def first_checkpoint():
        if p.poll() is not None:
            raise AssertionError(f"job ended ({p.returncode}) before its first checkpoint:\n{log.read_text()[-4000:]}")
        return checkpoint.latest_complete(ckpts) if ckpts.is_dir() else None
    wait_until(first_checkpoint, 300, "the first complete checkpoint", 0.2)
    assert steps_logged(run_dir) < steps, "job finished before the kill; raise train.steps"

    # the rank on node 127.0.0.2: the child of that node's launcher (--node_rank=1)
    def remote_rank():  # a rank's parent is its node's launcher; DataLoader workers' parent is a rank
        table = procs()
        ranks = [pid for pid, (ppid, _, cmd) in table.items()
                 if "-m pretrain.train" in cmd and "deepspeed.launcher.launch" not in cmd and ppid in table
                 and "deepspeed.launcher.launch" in table[ppid][2] and "--node_rank=1" in table[ppid][2]
                 and not table[ppid][2].startswith("ssh")]
        return ranks[0] if ranks else None
    rank1 = wait_until(remote_rank, 30, "the rank of node 127.0.0.2")
    before = job_pids(p, ssh_nodes, run_dir)
    assert len(before) >= 8, describe(before)  # runner, pdsh, 2 ssh, 2 launchers, 2 ranks, workers...
    killed_at = time.time()
    os.kill(rank1, signal.SIGKILL)

    try:
        wait_until(lambda: not job_pids(p, ssh_nodes, run_dir), DEAD_RANK_BOUND_S,
                   "every process of the job to exit", 1)
    except AssertionError:
        left = job_pids(p, ssh_nodes, run_dir)
        pytest.fail(f"{len(left)} process(es) of the job still alive {DEAD_RANK_BOUND_S} s after kill -9 of rank 1 "
                    f"(pid {rank1}):\n{describe(left)}\n--- job log (tail)\n{log.read_text()[-3000:]}")
    took = time.time() - killed_at
    assert p.poll() is not None and p.returncode != 0, f"runner exit {p.returncode} after a dead rank"
    last = checkpoint.latest_complete(ckpts)
    assert last is not None
    saved = json.loads((last / "run.json").read_text())["step"]

    # start again: resumes from the last complete checkpoint and finishes
    log2 = tmp_path / "second.log"
    out = finished(job(run_dir, log2, tmp_path, *common), log2, 400, "resumed job")
    m = re.search(r"resuming from step (\d+)", out)
    assert m, out[-4000:]
    assert int(m.group(1)) == saved, (m.group(0), last)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == steps, summary
    print(f"dead rank: job gone {took:.0f} s after kill -9; resumed from step {saved}")


def test_vit_launch_over_pdsh_trains_from_an_s3_store_on_both_nodes(ssh_nodes, tmp_path, monkeypatch):
    """``vit-launch run --hostfile`` over pdsh, shards in moto_server on 127.0.0.1: each node's rank
    reads the store only because vit-launch hands every node the store's location (endpoint, region,
    the shared credentials file) through the runner's DS_ENV_FILE; pdsh forwards no AWS_* variable.
    The keys themselves live in that credentials file, as on a cluster's shared home."""
    import sys

    from s3_server import MotoS3

    from data_pipeline.shards.writer import write_demo_shards

    run_dir, log = tmp_path / "run", tmp_path / "s3.log"
    with MotoS3(tmp_path / "moto.log") as s3:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        s3.client().create_bucket(Bucket="cluster")
        write_demo_shards("s3://cluster/demo/train", n=96, shard_size=12)
        creds = tmp_path / "credentials"
        creds.write_text(f"[default]\naws_access_key_id = {s3.env['AWS_ACCESS_KEY_ID']}\n"
                         f"aws_secret_access_key = {s3.env['AWS_SECRET_ACCESS_KEY']}\n")
        bin_dir = tmp_path / "bin"  # the runner's own `ssh HOST hostname` check reads only ssh's config
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {ssh_nodes.ssh_config} \"$@\"\n")
        (bin_dir / "ssh").chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(ssh_nodes.env, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONUNBUFFERED="1",
                   DS_ENV_FILE=str(ds_env_file(tmp_path / "deepspeed_env.user")), AWS_ENDPOINT_URL=s3.url,
                   AWS_DEFAULT_REGION=s3.env["AWS_DEFAULT_REGION"], AWS_SHARED_CREDENTIALS_FILE=str(creds))
        env.pop("VITSCALE_FAULT", None)
        cmd = [sys.executable, "-m", "launch", "run", "--hostfile", str(ssh_nodes.hostfile), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "--config", "configs/tiny_cpu.yaml",
               *train_overrides("s3://cluster/demo/train", run_dir, "data.allow_remote=true",
                                "data.record_samples=true", "train.steps=4", "checkpoint.every_steps=4")]
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            out = finished(p, log, 300, "vit-launch over pdsh from the store")
        finally:
            kill_pids(job_pids(p, ssh_nodes, run_dir))
    assert "8 shard(s) in the store with the recorded sizes" in out  # pre-flight read the store too
    assert (f"vit-launch: AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, AWS_SHARED_CREDENTIALS_FILE to every node through "
            f"DS_ENV_FILE={run_dir / 'deepspeed_env'}") in out, out[-3000:]
    assert "127.0.0.1" in out and "127.0.0.2" in out
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 4
    rows = {f.name: f.read_text().splitlines() for f in (run_dir / "samples").glob("rank-*.tsv")}
    assert sorted(rows) == ["rank-0.tsv", "rank-1.tsv"] and all(len(r) == 4 * 16 for r in rows.values()), rows.keys()
    assert "AWS_SECRET" not in (run_dir / "deepspeed_env").read_text()
