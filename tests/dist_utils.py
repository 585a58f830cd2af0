"""Helpers for tests that start real multi-process jobs through the deepspeed runner (CPU, gloo)."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from launch.runner import deepspeed_executable
from pretrain.distributed.process import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def console_scripts() -> dict[str, str]:
    """The commands setup.py installs: ``{name: "module:function"}``."""
    import re

    return dict(re.findall(r'"(vit-[a-z-]+)=([\w.]+:\w+)"', (REPO / "setup.py").read_text()))


def job_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PATH=f"{BIN}:{env.get('PATH', '')}")
    env.pop("VITSCALE_FAULT", None)
    env.pop("WANDB_SERVICE", None)  # an in-process W&B test's service must not be shared by the jobs
    env.update({k: str(v) for k, v in extra.items()})
    return env


def deepspeed_cmd(module: str, *args: str, ranks: int = 2) -> list[str]:
    return [deepspeed_executable(), "--num_gpus", str(ranks), "--master_port", str(free_port()),
            "--module", module, *args]


def run_job(cmd: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=job_env(**env), capture_output=True, text=True, timeout=timeout)


def start_job(cmd: list[str], log: Path, **env) -> subprocess.Popen:
    """Start in its own session so the whole tree (runner, launcher, ranks) can be signalled."""
    return subprocess.Popen(cmd, cwd=REPO, env=job_env(**env), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    os.killpg(proc.pid, sig)


def group_alive(proc: subprocess.Popen) -> bool:
    """Any process of the job's session still running? (The runner itself dies at once on
    SIGTERM; the launcher and the ranks go on to checkpoint.)"""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def reaped(proc: subprocess.Popen):
    """Yields ``proc``; on the way out SIGKILLs whatever of its process group still runs, so a
    test that fails half-way leaves no rank behind."""
    try:
        yield proc
    finally:
        if group_alive(proc):
            kill_group(proc)


def metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: record}; a step logged twice (re-run after a kill) keeps the last."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:  # training records (evaluation records share their step)
            out[r["step"]] = r
    return out


def wandb_records(path: Path):
    """Protobuf records of a W&B offline ``.wandb`` file (LevelDB-log framing: 7-byte file header,
    32 KiB blocks, each record chunk = crc32(4) + length(2) + type(1) + payload)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B data file"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left_in_block = block - pos % block
        if left_in_block < 7:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        chunks += payload
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            yield rec


def wandb_history(run: Path, until_key: str, timeout: float = 30, kind: str = "history") -> dict:
    """Every history key an offline W&B run logged (nested keys joined by ``/``; ``kind="summary"``:
    its summary's), read from its ``.wandb`` file until ``until_key`` is there: W&B's writer process
    may lag ``finish()``."""
    logged: dict = {}
    deadline = time.time() + timeout
    while until_key not in logged and time.time() < deadline:
        try:
            for rec in wandb_records(next(run.glob("*.wandb"))):
                if rec.WhichOneof("record_type") == kind:
                    items = rec.history.item if kind == "history" else rec.summary.update
                    logged.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
        except Exception:  # a record still being written: read again
            pass
        time.sleep(0.2)
    return logged


TINY_CONFIG = "configs/tiny_cpu.yaml"
TINY_MODEL = "test_vit"  # timm's test model: a tenth of ViT-Ti's CPU per step


@dataclass
class TinyRun:
    """One tiny training job on demo shards (``configs/tiny_cpu.yaml`` with ``TINY_MODEL``): steps
    of 16 images as two micro-batches of 8, no data workers, W&B off; ``extra`` overrides come last
    and win.

    ``via`` says how it starts: ``python`` (``python -m pretrain.train``, one process),
    ``deepspeed`` (the deepspeed runner with ``ranks`` local ranks) or ``launch`` (``vit-launch run
    --skip-checks`` with ``ranks`` GPUs per node and ``launch_args`` before the overrides)."""
    shards: Path | str
    run_dir: Path
    extra: tuple[str, ...] = ()
    via: str = "python"
    ranks: int = 1
    launch_args: tuple[str, ...] = ()

    def overrides(self) -> list[str]:
        return [f"model.name={TINY_MODEL}", f"data.train_shards={self.shards}", f"train.output_dir={self.run_dir}",
                "train.global_batch_size=16", "train.micro_batch_size=8", "data.workers=0",
                "logging.wandb.mode=disabled", *self.extra]

    def args(self) -> list[str]:
        """vit-train's arguments: the config and the overrides."""
        return ["--config", TINY_CONFIG, *self.overrides()]

    def cmd(self) -> list[str]:
        args = self.args()
        if self.via == "python":
            return [sys.executable, "-m", "pretrain.train", *args]
        if self.via == "deepspeed":
            return deepspeed_cmd("pretrain.train", *args, ranks=self.ranks)
        if self.via == "launch":
            return [sys.executable, "-m", "launch", "run", "--skip-checks", "--gpus-per-node", str(self.ranks),
                    "--master-port", str(free_port()), *self.launch_args, *args]
        raise ValueError(f"TinyRun.via={self.via!r}: expected python, deepspeed or launch")

    def run(self, timeout: int = 600, **env) -> subprocess.CompletedProcess:
        """Run to the end; the caller reads ``returncode`` (some tests expect a failure)."""
        return run_job(self.cmd(), timeout=timeout, **env)

    def start(self, log: Path, **env) -> subprocess.Popen:
        return start_job(self.cmd(), log, **env)

    def metrics(self) -> dict[int, dict]:
        return metrics(self.run_dir)


def train_single(shards, run_dir, *extra, env=None, timeout=240) -> subprocess.CompletedProcess:
    """``python -m pretrain.train`` of a :class:`TinyRun` (one process)."""
    cmd = TinyRun(shards, run_dir, extra).cmd()
    return subprocess.run(cmd, cwd=REPO, env=env or job_env(), capture_output=True, text=True, timeout=timeout)


def demo_manifest(tmp_path_factory, n: int, shard_size: int) -> Path:
    """``n`` demo images (real JPEGs) in shards of ``shard_size``: the manifest of a module's data."""
    from data_pipeline.shards.writer import write_demo_shards

    out = tmp_path_factory.mktemp(f"demo{n}x{shard_size}") / "train"
    write_demo_shards(out, "train", n=n, shard_size=shard_size)
    return out / "manifest.json"
