"""Two "nodes" that talk over a real kernel link the test shapes and cuts.

Rank 0 runs in network namespace A, rank 1 in namespace B; a veth pair (169.254.77.1/30 <->
169.254.77.2/30, ``veth_nodes`` in conftest.py) is the only path between them, so the TCPStore
rendezvous and every gloo collective cross it (``GLOO_SOCKET_IFNAME`` names each end). The ranks
are started directly with the variables the deepspeed launcher sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_SIZE=1``: one rank per node, so DeepSpeed's shared-memory path stays off), no sshd needed.

1. Slow link: ``tc tbf`` on both ends. The job trains to the end with the losses of an unshaped
   run of the same job, at lower img/s; the added step time lands in backward and step (ZeRO's
   gradient reduction), and no rank is named a straggler (a slow link slows every rank alike).
2. Partition: ``ip link set <veth> down`` mid-run. Every process of the job ends within
   ``PG_TIMEOUT_S + EXIT_S`` when gloo ended a collective of the default group, within
   ``watchdog_bound`` when the hang watchdog had to end it (derived below from
   ``train.pg_timeout_s`` and the watchdog's timings); one line says why; the newest checkpoint
   verifies; with the link up again a restart resumes from that checkpoint's step and finishes.
3. Flap: the link down for ``FLAP_S`` s (shorter than any timeout), then up: the job goes on to
   the end without a restart (TCP retransmits what was lost).

After a timed-out collective each rank asks through the rendezvous store (its own TCP connection to
rank 0's host) who still answers, and names the peer that does not (or rank 0's host, when the
store itself is out of reach); the watchdog's line, when it ends the job instead, names ranks and
phases.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO, descendants, kill_pids, procs, train_overrides, wait_until
from dist_utils import free_port, job_env
from netns import ADDR, Link

from pretrain.checkpointing import checkpoint
from pretrain.checkpointing.rundir import verify

pytestmark = pytest.mark.cluster

CONFIG = "configs/tiny_cpu.yaml"
WORLD, GLOBAL_BATCH = 2, 32  # GLOBAL_BATCH: train_overrides' train.global_batch_size

# --- slow link: 400 Mbit/s each way. This job sends ~35 MB per step each way (ZeRO-2 on ViT-Tiny's
# 5.5M fp32 parameters), so 4 Mbit/s would take over a minute per step; 400 Mbit/s makes the step
# 2-4x slower on 2 CPU cores and keeps the test short.
RATE, RATE_BITS = "400mbit", 400e6
# --- partition: the loop's own collectives (agree, log, stop) run on the default process group,
# which gloo ends after train.pg_timeout_s; DeepSpeed's gradient reduction (backward, step) runs on
# a group of its own that keeps torch's 30 min default, so a cut there is ended by the hang watchdog:
# after train.hang_timeout_s (3x inside a checkpoint save), its poll (<= hang/5, at most 5 s) and its
# wait for the other ranks' stack files (min(30, max(10, hang))). EXIT_S: process teardown (data
# workers, W&B offline) on a busy 2-core machine. The test cuts right after a checkpoint, in the next
# step's forward or backward: either path happens, depending on the machine's load.
PG_TIMEOUT_S, HANG_TIMEOUT_S, EXIT_S = 10, 15, 15


def watchdog_bound(in_checkpoint: bool) -> float:
    return ((3 if in_checkpoint else 1) * HANG_TIMEOUT_S + min(30, max(10, HANG_TIMEOUT_S))
            + max(0.5, min(5, HANG_TIMEOUT_S / 5)) + EXIT_S)


PARTITION_BOUND_S = max(PG_TIMEOUT_S + EXIT_S, watchdog_bound(in_checkpoint=True))  # whatever was cut
FLAP_S = 3.0


# ------------------------------------------------------------------------------------------ jobs
@dataclass
class NetJob:
    """Rank 0 in namespace A, rank 1 in namespace B; logs ``<log>.rank<R>``."""
    link: Link
    run_dir: Path
    log: Path
    ranks: list = field(default_factory=list)

    def start(self, *overrides: str) -> "NetJob":
        port = str(free_port())
        for rank, side in enumerate("ab"):
            env = job_env(MASTER_ADDR=ADDR["a"], MASTER_PORT=port, RANK=rank, WORLD_SIZE=WORLD, LOCAL_RANK=0,
                          LOCAL_SIZE=1, LOCAL_WORLD_SIZE=1, CROSS_RANK=rank, CROSS_SIZE=WORLD,
                          GLOO_SOCKET_IFNAME=self.link.dev[side])
            cmd = [*self.link.prefix(side), sys.executable, "-m", "pretrain.train", "--config", CONFIG, *overrides]
            self.ranks.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.rank_log(rank), "w"),
                                               stderr=subprocess.STDOUT, start_new_session=True))
        return self

    def rank_log(self, rank: int) -> Path:
        return self.log.with_name(f"{self.log.name}.rank{rank}")

    def output(self, tail: int = 3000) -> str:
        return "\n".join(f"--- rank {r}\n{self.rank_log(r).read_text()[-tail:]}" for r in range(len(self.ranks)))

    def pids(self) -> set[int]:
        """Every live process of the job: the ranks, their sessions and descendants (data workers,
        W&B's service), and anything whose command line names the run folder."""
        table = procs()
        roots = {p.pid for p in self.ranks}
        out = {pid for pid, (_, sid, cmd) in table.items() if sid in roots or str(self.run_dir) in cmd}
        for root in roots:
            out |= descendants(root, table) | ({root} & table.keys())
        return out

    def wait(self, timeout: float) -> list[int]:
        end = time.time() + timeout
        for p in self.ranks:
            try:
                p.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"job still running after {timeout:.0f} s:\n{self.output()}")
        return [p.returncode for p in self.ranks]

    def running(self) -> bool:
        if any(p.poll() is not None for p in self.ranks):
            raise AssertionError(f"a rank ended early ({[p.poll() for p in self.ranks]}):\n{self.output()}")
        return True


@pytest.fixture
def net_job(veth_nodes, demo_manifest):
    """Start jobs across the veth pair; at teardown SIGKILL whatever of theirs is left (by PID), even
    on failure, before ``veth_nodes`` deletes the namespaces."""
    started: list[NetJob] = []

    def run(run_dir: Path, log: Path, *overrides: str) -> NetJob:
        job = NetJob(veth_nodes, run_dir, log).start(*train_overrides(demo_manifest, run_dir, *overrides))
        started.append(job)
        return job

    yield run
    for job in started:
        kill_pids(job.pids())
        for p in job.ranks:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def records(run_dir: Path) -> dict[int, dict]:
    """Training records of metrics.jsonl by step (a step logged again after a resume keeps the last)."""
    out = {}
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r
    except (OSError, ValueError):
        pass
    return out


def window_means(recs: dict[int, dict], steps: list[int]) -> dict[str, float]:
    """img/s, each phase's share and each phase's seconds per step (share x step time), averaged over
    the logging windows that end at ``steps``."""
    out: dict[str, float] = {}
    for st in steps:
        r = recs[st]
        step_s = GLOBAL_BATCH / r["images_per_sec"]
        vals = {"images_per_sec": r["images_per_sec"], "step_s": step_s}
        for k, v in r.items():
            if k.startswith("phase_share/"):
                vals[k] = v
                vals["seconds/" + k.split("/", 1)[1]] = v * step_s
        for k, v in vals.items():
            out[k] = out.get(k, 0.0) + v / len(steps)
    return out


def finished(job: NetJob, steps: int) -> Path:
    """Every rank exited 0, the run reached ``steps`` and its last checkpoint verifies; that checkpoint."""
    codes = job.wait(240)
    assert codes == [0] * WORLD, f"exit codes {codes}:\n{job.output()}"
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["step"] == steps, summary
    last = checkpoint.latest_complete(job.run_dir / "checkpoints")
    assert last is not None and last.name == f"step_{steps:08d}", last
    assert verify(last) is None, verify(last)
    return last


# ----------------------------------------------------------------------------------------- tests
def test_slow_link_trains_to_the_end_and_time_goes_to_communication(veth_nodes, net_job, tmp_path):
    steps, every = 12, 4
    common = (f"train.steps={steps}", f"train.log_every_steps={every}", f"checkpoint.every_steps={steps}")

    sent0 = veth_nodes.bytes_sent("a")
    base = net_job(tmp_path / "base", tmp_path / "base.log", *common)
    finished(base, steps)
    wire_bytes = (veth_nodes.bytes_sent("a") - sent0) / steps  # rank 0 -> rank 1, per step
    # the gradient reduction alone sends half the fp32 gradient each way (5.5M parameters): proof that
    # the collectives crossed the veth, not loopback or shared memory
    assert wire_bytes > 5.5e6 * 4 / 2, f"{wire_bytes / 1e6:.1f} MB per step on {veth_nodes.dev['a']}"

    veth_nodes.shape(RATE)
    assert "tbf" in veth_nodes.qdisc("a") and "tbf" in veth_nodes.qdisc("b")
    slow = net_job(tmp_path / "slow", tmp_path / "slow.log", *common)
    finished(slow, steps)

    b, s = records(base.run_dir), records(slow.run_dir)
    assert sorted(b) == sorted(s) == list(range(every, steps + 1, every)), (sorted(b), sorted(s))
    # nothing lost: the same losses step for step (the link changes when bytes arrive, not which)
    for step in b:
        assert s[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-5), (step, b[step]["loss"], s[step]["loss"])

    later = [st for st in b if st > every]  # the first window holds start-up's first step
    mb, ms = window_means(b, later), window_means(s, later)
    share_b = mb["phase_share/backward"] + mb["phase_share/step"]
    share_s = ms["phase_share/backward"] + ms["phase_share/step"]
    added = {k.split("/")[1]: ms[k] - mb[k] for k in mb if k.startswith("seconds/")}
    report = (f"img/s {mb['images_per_sec']:.1f} -> {ms['images_per_sec']:.1f} "
              f"({ms['images_per_sec'] / mb['images_per_sec']:.2f}x) at {RATE}; backward+step share {share_b:.2f} -> "
              f"{share_s:.2f}; added s/step " + ", ".join(f"{k} {v:+.2f}" for k, v in added.items())
              + f"; {wire_bytes / 1e6:.1f} MB/step on the wire")
    print(report)

    assert ms["images_per_sec"] < 0.8 * mb["images_per_sec"], report
    assert share_s > share_b + 0.05, report
    # where the time went: most of the added step time is in the collective phases
    assert added["backward"] + added["step"] > 0.7 * sum(added.values()), report
    # physics: a step cannot be shorter than its bytes at the shaped rate
    assert ms["step_s"] > 0.9 * wire_bytes * 8 / RATE_BITS, report
    # a slow link slows every rank alike: no rank is named a straggler (single windows of a few steps
    # on a shared 2-core machine can pass the ratio; naming sums train.straggler_windows of them)
    assert "straggler:" not in slow.rank_log(0).read_text(), [s[st]["straggler/ratio"] for st in s]


def test_partition_ends_job_within_bound_then_resumes(veth_nodes, net_job, tmp_path):
    steps = 30
    common = (f"train.steps={steps}", "checkpoint.every_steps=5", "checkpoint.keep_last=3",
              f"train.pg_timeout_s={PG_TIMEOUT_S}", f"train.hang_timeout_s={HANG_TIMEOUT_S}")
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    job = net_job(run_dir, tmp_path / "first.log", *common)

    wait_until(lambda: job.running() and ckpts.is_dir() and checkpoint.latest_complete(ckpts), 240,
               "the first complete checkpoint", 0.2)
    assert max(records(run_dir), default=0) < steps, "job finished before the cut; raise train.steps"
    before = job.pids()
    assert len(before) >= WORLD, before

    cut_at = time.time()
    veth_nodes.set_link("b", up=False)  # in rank 1's namespace: A loses its carrier too
    assert veth_nodes.state("a") == veth_nodes.state("b") == "DOWN"
    try:
        wait_until(lambda: not job.pids(), PARTITION_BOUND_S, "every process of the job to exit", 0.5)
    except AssertionError:
        left = job.pids()
        table = procs()
        pytest.fail(f"{len(left)} process(es) alive {PARTITION_BOUND_S:.0f} s after the cut: "
                    + "; ".join(table[p][2][:100] for p in left if p in table) + f"\n{job.output()}")
    took = time.time() - cut_at
    codes = [p.wait(5) for p in job.ranks]
    assert all(c != 0 for c in codes), f"exit codes {codes} after a partition"
    out = job.output(20000)
    hang = re.search(r"vit-train: hang: .*", out)  # the watchdog: a cut inside DeepSpeed's reduction
    gloo = re.search(r"Timed out waiting \d+ms for \w+ operation.*", out)  # a collective of the default group
    why = hang or gloo
    assert why, f"no line says why the job ended:\n{out[-4000:]}"
    bound = watchdog_bound("in checkpoint of" in hang.group(0)) if hang else PG_TIMEOUT_S + EXIT_S
    assert took <= bound, f"{took:.1f} s > {bound:.0f} s ({why.group(0)[:160]})"
    if gloo:  # a timed-out collective: the ranks ask through the store who is gone and name it
        peer = re.search(r"vit-train: rank \d on \S+: (no answer within [\d.]+ s from rank \d on \S+|rank 0's host "
                         r"\S+ \(rendezvous at [\d.]+\) is unreachable)", out)
        assert peer, f"no line names the unreachable peer:\n{out[-4000:]}"

    last = checkpoint.latest_complete(ckpts)
    assert last is not None
    assert verify(last) is None, verify(last)
    saved = json.loads((last / "run.json").read_text())["step"]
    print(f"partition: all {len(before)} processes gone {took:.1f} s after the cut (bound {bound:.0f} s), exit "
          f"codes {codes}; '{why.group(0)[:160]}'; newest checkpoint step {saved}")

    # the link back: a restart resumes from that checkpoint and finishes
    veth_nodes.set_link("b", up=True)
    wait_until(veth_nodes.reachable, 20, "169.254.77.2 reachable from A again", 0.5)
    again = net_job(run_dir, tmp_path / "second.log", *common)
    finished(again, steps)
    out2 = again.rank_log(0).read_text()
    m = re.search(r"resuming from step (\d+)", out2)
    assert m, out2[-4000:]
    assert int(m.group(1)) == saved, (m.group(0), last)
    logged = sorted(records(run_dir))
    assert logged[-1] == steps and all(st % 5 == 0 for st in logged), logged


def test_link_flap_shorter_than_timeouts_does_not_stop_training(veth_nodes, net_job, tmp_path):
    steps = 30
    job = net_job(tmp_path / "run", tmp_path / "flap.log", f"train.steps={steps}", f"checkpoint.every_steps={steps}",
                  f"train.pg_timeout_s={PG_TIMEOUT_S}", f"train.hang_timeout_s={HANG_TIMEOUT_S}")
    wait_until(lambda: job.running() and records(job.run_dir), 240, "the first log line", 0.2)
    ranks_before = [p.pid for p in job.ranks]

    down_at = time.time()
    veth_nodes.set_link("a", up=False)  # in rank 0's namespace: its route to B is gone meanwhile
    at = max(records(job.run_dir))
    assert veth_nodes.state("a") == "DOWN" and not veth_nodes.reachable(timeout_s=0.5)
    time.sleep(max(0.0, FLAP_S - (time.time() - down_at)))
    veth_nodes.set_link("a", up=True)
    down_s = time.time() - down_at
    wait_until(lambda: veth_nodes.state("a") == veth_nodes.state("b") == "UP", 10, "both veth ends up again")
    assert job.running() and at < steps, f"the flap must land mid-run (last logged step {at})"

    finished(job, steps)
    assert [p.pid for p in job.ranks] == ranks_before
    out = job.rank_log(0).read_text()
    assert "starting from scratch" in out and "resuming from step" not in out, out[-3000:]
    logged = sorted(records(job.run_dir))
    assert logged == list(range(5, steps + 1, 5)), logged
    recs = records(job.run_dir)
    slowest = min(logged[1:], key=lambda st: recs[st]["images_per_sec"])
    print(f"flap: link down {down_s:.1f} s after step {at}; no restart; slowest window ends at step {slowest} "
          f"({GLOBAL_BATCH / recs[slowest]['images_per_sec']:.2f} s/step)")
