"""The layout of a run directory: the one module that knows where a run keeps what.

    <train.output_dir>/
        config.yaml            the resolved config (every key)
        metrics.jsonl          rank 0's metrics, one JSON object per log step
        summary.json           how the last invocation ended (step, losses, seconds, ...)
        status.json            {"state": running|completed|interrupted|failed, "step", "exit_code",
                               "device_seconds_spent": every invocation's, failed ones included}
        hang/rank-<R>.txt      every thread's Python stack of rank R when the hang watchdog fired
        errors/rank-<R>.txt    rank R's record when it failed: a JSON line (rank, host, time, what
                               happened, the peers that did not answer), then its traceback
        stop.request           written by `vit-launch run` to ask the job to checkpoint and stop
        hostfile.used          the hostfile `vit-launch run` last started the job with (a comment
                               line for each node it left out, and why)
        samples/rank-<R>.tsv   with data.record_samples: step<TAB>epoch<TAB>key per consumed sample
        profile/steps-S-E/     with logging.profile: rank-<R>.json.gz (the Chrome trace of steps S-E),
                               rank-<R>.txt (op table), rank-<R>.json (summary)
        checkpoints/           (or checkpoint.dir)
            latest             tag of the newest complete checkpoint, for DeepSpeed's own tools
                               (zero_to_fp32.py); our readers list the COMPLETE markers instead
            step_00001000/     DeepSpeed engine state + rank_<R>.json + run.json + COMPLETE
            damaged/           checkpoints that failed verification, set aside (never deleted)
            earlier-K/         the checkpoints an earlier run left here, set aside by a fresh start
                               (``checkpoint.resume: false``) before its own saves prune them

A checkpoint is *complete* once its ``COMPLETE`` marker exists (written by rank 0 after every
rank finished writing); the marker records the size (and a CRC32 where cheap) of every file, so
``verify`` can tell a checkpoint damaged after the fact (a deleted or truncated file).
Foreign DeepSpeed runs (tags ``global_stepN``, no markers) count the tag ``latest`` names as
complete, since DeepSpeed writes ``latest`` last; our own tags count by their marker alone
(``latest`` still names a checkpoint while it is saved again, or after it was set aside).
"""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.files import write_atomic

COMPLETE = "COMPLETE"
LATEST = "latest"
DAMAGED = "damaged"
EARLIER = "earlier"
_TAG = re.compile(r"^(?:step_|global_step)(\d+)$")
CHECKSUM_MAX_BYTES = 256 << 20  # larger files are checked by size only (a CRC would re-read GBs)


@dataclass(frozen=True)
class RunDir:
    root: Path
    checkpoints: Path

    @classmethod
    def of(cls, output_dir: str | Path, checkpoint_dir: Optional[str | Path] = None) -> "RunDir":
        """From ``train.output_dir`` and ``checkpoint.dir`` (None: ``<output_dir>/checkpoints``)."""
        root = Path(output_dir)
        return cls(root, Path(checkpoint_dir) if checkpoint_dir else root / "checkpoints")

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def hang(self) -> Path:
        return self.root / "hang"

    @property
    def errors(self) -> Path:
        return self.root / "errors"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def stragglers(self) -> Path:
        """The ranks and hosts named as stragglers (rank 0 writes it; ``vit-launch run
        --exclude-slow-hosts`` reads it before a restart)."""
        return self.root / "stragglers.json"

    @property
    def stop_request(self) -> Path:
        """Written by ``vit-launch run`` to ask the job to checkpoint and stop (rank 0 looks at its
        sync points; the first line is the reason)."""
        return self.root / "stop.request"

    @property
    def hostfile_used(self) -> Path:
        """The hostfile ``vit-launch run`` last started the job with, when it chooses the nodes
        (``--max-restarts``, ``--exclude-slow-hosts``; ``launch/nodes.py``)."""
        return self.root / "hostfile.used"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str | Path) -> Optional[int]:
    """The step of a checkpoint tag (``step_00001000``, DeepSpeed's ``global_step1000``)."""
    m = _TAG.match(Path(path).name)
    return int(m.group(1)) if m else None


def checkpoint_root(path: str | Path) -> Path:
    """Where a run keeps its checkpoints, given the run directory or the checkpoint root itself:
    PATH when it holds checkpoint tags, else the ``checkpoint.dir`` of PATH/config.yaml when set,
    else PATH/checkpoints."""
    p = Path(path)
    if p.is_dir() and ((p / LATEST).is_file() or any(step_of(d) is not None for d in p.iterdir() if d.is_dir())):
        return p
    cfg = p / "config.yaml"
    if cfg.is_file():
        import yaml

        try:
            d = ((yaml.safe_load(cfg.read_text()) or {}).get("checkpoint") or {}).get("dir")
        except yaml.YAMLError:
            d = None
        if d:
            return Path(d)
    return p / "checkpoints"


def list_complete(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints (marker present; in a foreign DeepSpeed run, the ``global_step`` tag
    ``latest`` names), oldest first. Says nothing about their files: see ``verify``."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    tags = {p.name for p in d.iterdir() if p.is_dir() and step_of(p) is not None and (p / COMPLETE).is_file()}
    try:
        latest = (d / LATEST).read_text().strip()
    except OSError:  # absent, or being replaced right now
        latest = ""
    if latest.startswith("global_step") and step_of(latest) is not None and (d / latest).is_dir():
        tags.add(latest)
    return sorted((d / t for t in tags), key=step_of)


def latest_complete(ckpt_dir: str | Path) -> Optional[Path]:
    done = list_complete(ckpt_dir)
    return done[-1] if done else None


# -------------------------------------------------------------------------------- verification
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def describe_files(ckpt: Path) -> dict[str, list]:
    """{relative path: [size, crc32 or None]} for every file under ``ckpt`` (the marker excepted)."""
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != COMPLETE:
            size = p.stat().st_size
            files[p.relative_to(ckpt).as_posix()] = [size, _crc32(p) if size <= CHECKSUM_MAX_BYTES else None]
    return files


def marker(step: int, ckpt: Path) -> str:
    """The text of ``COMPLETE``: the step and what the checkpoint's files must be."""
    return json.dumps({"step": step, "files": describe_files(ckpt)})


def verify(ckpt: Path) -> Optional[str]:
    """None when every file the marker lists is there with its size and checksum; else one line
    saying what is wrong. A marker without a file list (older runs, DeepSpeed's) is trusted."""
    ckpt = Path(ckpt)
    try:
        recorded = json.loads((ckpt / COMPLETE).read_text()).get("files")
    except FileNotFoundError:
        return None if ckpt.is_dir() else f"{ckpt}: not found"
    except (OSError, ValueError, AttributeError) as e:
        return f"{ckpt / COMPLETE}: unreadable marker ({e})"
    for rel, (size, crc) in (recorded or {}).items():
        p = ckpt / rel
        if not p.is_file():
            return f"{p}: missing"
        have = p.stat().st_size
        if have != size:
            return f"{p}: {have} bytes, the checkpoint recorded {size}"
        if crc is not None and _crc32(p) != crc:
            return f"{p}: checksum differs from the one recorded at save time"
    return None


def newest_valid(ckpt_dir: str | Path, warn,
                 step: Optional[int] = None) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest complete checkpoint whose files verify (or the one at ``step``), and the
    damaged ones met on the way as (path, reason); ``warn(message)`` is called once for each."""
    damaged = []
    for ckpt in reversed(list_complete(ckpt_dir)):
        if step is not None and step_of(ckpt) != step:
            continue
        why = verify(ckpt)
        if why is None:
            return ckpt, damaged
        damaged.append((ckpt, why))
        warn(f"checkpoint {ckpt.name} is damaged ({why}); falling back to the one before it")
    return None, damaged


def set_aside(ckpt: Path) -> Path:
    """Move a damaged checkpoint to ``<ckpt_dir>/damaged/`` (never deleted silently)."""
    dest_dir = ckpt.parent / DAMAGED
    dest_dir.mkdir(exist_ok=True)
    dest, n = dest_dir / ckpt.name, 1
    while dest.exists():
        dest, n = dest_dir / f"{ckpt.name}.{n}", n + 1
    ckpt.rename(dest)
    return dest


def pick(ckpt_dir: str | Path, warn) -> Optional[Path]:
    """The checkpoint a resume loads: the newest complete one whose files verify. Damaged newer
    ones are moved to ``damaged/`` (``warn`` says each), and ``latest`` then names the one picked
    (or, with none left, is removed), as DeepSpeed's tools read it."""
    ckpt_dir = Path(ckpt_dir)
    path, damaged = newest_valid(ckpt_dir, warn)
    for bad, _ in damaged:
        warn(f"moved {bad.name} to {set_aside(bad)}")
    if damaged:
        if path is not None:
            write_atomic(ckpt_dir / LATEST, path.name)
        else:
            (ckpt_dir / LATEST).unlink(missing_ok=True)
    return path


def set_aside_earlier(ckpt_dir: str | Path) -> Optional[Path]:
    """A fresh start in a checkpoint folder that holds an earlier run's checkpoints (complete or
    not) moves them, with ``latest``, to the first free ``earlier-K/`` beside them and returns it
    (None when there was nothing to move): kept whole, and out of reach of this run's pruning,
    which keeps the newest ``checkpoint.keep_last`` by step whichever run wrote them."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return None
    tags = [p for p in d.iterdir() if p.is_dir() and step_of(p) is not None]
    if not tags:
        return None
    k = 1
    while (d / f"{EARLIER}-{k}").exists():
        k += 1
    dest = d / f"{EARLIER}-{k}"
    dest.mkdir()
    for p in [*tags, d / LATEST]:
        if p.exists():
            p.rename(dest / p.name)
    return dest


def find_checkpoint(path: str | Path, step: Optional[int] = None, warn=None) -> Path:
    """A verified complete checkpoint of a run: ``path`` may be the run directory, its checkpoint
    root, or one checkpoint (``.../step_00001000``). Damaged newer ones are skipped with a warning.
    Raises FileNotFoundError (no such path) or LookupError (nothing complete and intact)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: run directory not found")
    if (p / COMPLETE).is_file():
        why = verify(p)
        if why:
            raise LookupError(f"{p}: damaged checkpoint ({why})")
        return p
    root = checkpoint_root(p)
    found, damaged = newest_valid(root, warn or (lambda msg: None), step)
    if found is not None:
        return found
    what = f"step {step}" if step is not None else "complete checkpoint"
    names = [c.name for c in list_complete(root)]
    extra = f" (complete: {', '.join(names)})" if names and step is not None else ""
    if damaged:
        extra += "; damaged: " + "; ".join(why for _, why in damaged)
    raise LookupError(f"{p}: no intact {what} in {root}{extra}")
