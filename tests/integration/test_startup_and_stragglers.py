"""Start-up never spins, and a slow rank is named: real processes, real signals.

* DeepSpeed's CPU shared-memory all-reduce set-up busy-waits (in C++, holding the GIL) for every
  peer's buffer file. A peer that joined the process group and died before creating its file left
  rank 0 spinning forever; ``train.startup_timeout_s`` ends it with one line naming the phase.
* One rank of a 2-rank job stopped half its time in bursts for real (SIGSTOP / SIGCONT for 0.1-0.5 s
  each, at irregular times; logging every 5 steps, the default factor and span) is named within 10
  logging windows; the same job unslowed, run beside it, names nobody in 20 windows (of 4 steps, 3
  under ZeRO-3), all while the machine is busy with the slowed job and the rest of the suite: four ranks
  and the other test worker on two cores, where each rank waits for a core most of its time, and
  which rank waits is chance (test_step_parts models 200 windows of such a machine). Both under
  ZeRO-2 and under ZeRO-3, where every submodule's forward waits for its parameters' all-gather,
  and so for the slow peer: that wait is the clock's ``gather`` phase, not the rank's own forward.
"""
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import REPO, free_port, group_alive, job_env, kill_group, metrics, reaped, wait_for

PEER_THAT_DIES = """
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", rank=1, world_size=2)
import os
os._exit(0)  # before DeepSpeed's shm set-up would create this rank's buffer file
"""


def test_a_peer_dead_before_the_shm_setup_ends_start_up_within_the_bound(tiny_run, tmp_path):
    port = str(free_port())
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    log = tmp_path / "rank0.txt"
    t0 = time.time()
    rank0 = tiny_run("train.startup_timeout_s=8").start(log, **env)
    peer = subprocess.Popen([sys.executable, "-c", PEER_THAT_DIES], cwd=REPO, env=job_env(**dict(env, RANK="1")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        peer.wait(60)
        rank0.wait(90)
    finally:
        for p in (rank0, peer):
            if p.poll() is None or group_alive(p):
                kill_group(p) if p is rank0 else p.kill()
    took = time.time() - t0
    out = log.read_text()
    assert rank0.returncode != 0 and took < 60, (took, out[-3000:])
    lines = [ln for ln in out.splitlines() if "start-up did not finish" in ln]
    assert len(lines) == 1, out[-3000:]
    assert "train.startup_timeout_s=8 s (phase: process group and DeepSpeed's communication set-up)" in lines[0]


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of training rank ``rank`` under the runner started as ``root`` (by its environment)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != root:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        if f"RANK={rank}".encode() in env and b"pretrain.train" in cmdline:
            return int(d.name)
    return None


def straggler_job(tiny_run, name: str, log: Path, every: int, steps: int, stage: int):
    # ViT-Ti, not the tiny jobs' test_vit: windows of its steps (about 0.2 CPU-s a rank) are long against
    # the scheduling noise of the loaded machine, which the even job must not mistake for a straggler.
    # ZeRO-3 without prefetching: every submodule's forward waits for its own all-gather, as in a model
    # many times the prefetch bucket (ViT-Tiny fits in one, and would be gathered whole at the start)
    zero3 = ("zero.stage3_prefetch_bucket_size=0",) if stage == 3 else ()
    return tiny_run("model.name=vit_tiny_patch16_224", f"train.steps={steps}", f"train.log_every_steps={every}",
                    "checkpoint.every_steps=100000", f"zero.stage={stage}", *zero3, via="deepspeed", ranks=2,
                    name=name).start(log)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_slowed_in_bursts_is_named_and_an_even_job_names_nobody(tiny_run, tmp_path, stage):
    """The even job runs beside the slowed one: four ranks and the other test worker on two cores,
    the loaded machine it must not name anyone on."""
    even_run, even_log = tmp_path / "even", tmp_path / "even.txt"
    # 20 windows either way (ZeRO-3's steps are about twice as long), each beside the slowed job: it is
    # named after about as many of the even job's steps as these (longer would add unloaded windows)
    every = 4 if stage == 2 else 3
    with reaped(straggler_job(tiny_run, "even", even_log, every=every, steps=20 * every, stage=stage)) as even:
        run, log = tmp_path / "slow", tmp_path / "slow.txt"
        job = straggler_job(tiny_run, "slow", log, every=5, steps=2000, stage=stage)
        try:
            wait_for(lambda: (run / "metrics.jsonl").exists() and max(metrics(run), default=0) >= 5, 240, job,
                     "step 5")
            before = max(metrics(run))
            pid = _rank_pid(job.pid, 1)
            assert pid is not None
            end, bursts = time.time() + 180, random.Random(0)
            while time.time() < end and "straggler: rank 1" not in log.read_text():
                # rank 1 runs about half of the time, stopped in bursts of 0.1-0.5 s at irregular times
                # (a strictly periodic pattern can phase-lock the job so that every burst lands in the
                # collective phases, where its peer waits as long as it does: see straggler.py)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(bursts.uniform(0.1, 0.5))
                os.kill(pid, signal.SIGCONT)
                time.sleep(bursts.uniform(0.1, 0.5))
            named_at = max(metrics(run))
        finally:
            kill_group(job)
        out = log.read_text()
        lines = [ln for ln in out.splitlines() if "straggler:" in ln]
        assert lines and lines[0].split("straggler: ")[1].startswith("rank 1 on "), out[-3000:]
        assert "x the median step, mostly in " in lines[0]
        print(f"ZeRO-{stage}: rank 1 named after {(named_at - before) / 5:g} windows")  # pytest -s shows it
        assert named_at - before <= 5 * 10, (before, named_at)  # within ten windows of five steps
        recs = [r for s, r in sorted(metrics(run).items()) if s > before and "straggler/ratio" in r]
        assert recs and recs[-1]["straggler/slowest_rank"] == 1 and recs[-1]["straggler/ratio"] >= 1.5

        code = even.wait(300)
    assert code == 0, even_log.read_text()[-3000:]
    m = metrics(even_run)
    assert sorted(m) == list(range(every, 20 * every + 1, every)) and all("straggler/ratio" in r for r in m.values())
    print(f"ZeRO-{stage}: even job's highest span ratio {max(r['straggler/ratio'] for r in m.values()):.2f}")
    assert "straggler:" not in even_log.read_text(), (max(r["straggler/ratio"] for s, r in m.items() if s >= 6),
                                                      even_log.read_text()[-2000:])


def test_waiting_on_the_compiled_op_build_lock_is_said(tiny_run, tmp_path):
    """Another process holds the build lock of DeepSpeed's CPU shm op (as while it builds it): the
    rank says so after 10 s instead of waiting silently, still in the process-group set-up."""
    import shutil

    from filelock import FileLock
    from torch.utils.cpp_extension import _get_build_directory

    real = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)).parent.parent
    ext = tmp_path / "ext"
    shutil.copytree(real, ext)  # the built op: no rebuild, only its lock is taken
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext)
    try:
        lock_path = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    lock = FileLock(str(lock_path))
    lock.acquire()
    log = tmp_path / "log.txt"
    job = tiny_run("train.steps=2", "checkpoint.every_steps=1000").start(log, TORCH_EXTENSIONS_DIR=str(ext))
    try:
        wait_for(lambda: "of a compiled op's build" in log.read_text(), 90, job, "the lock line")
        assert job.poll() is None and "building vit_tiny" not in log.read_text()  # still waiting for it
    finally:
        kill_group(job)
        lock.release()
    line = [ln for ln in log.read_text().splitlines() if "of a compiled op's build" in ln]
    assert len(line) == 1 and str(lock_path) in line[0] and "waiting 10+ s" in line[0]
