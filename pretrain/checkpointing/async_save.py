"""Asynchronous checkpoints (``checkpoint.async: true``): training goes on while the files are written.

DeepSpeed 0.19 ships two ways to write in the background, and neither fits: its decoupled engine
(``DecoupledCheckpointEngine``) hands the *live* state dict to a writer process and makes the
next optimizer step wait for the write (``_commit_decoupled_checkpoint`` before
``_take_model_step``), so a save still blocks training for nearly the whole write once steps are
shorter than the write; and its FastPersist writer needs the ``async_io`` op (libaio) even with
its python writer. torch's ``distributed.checkpoint.async_save`` writes its own format, not the
files DeepSpeed resumes from. So :class:`SnapshotEngine` plugs into DeepSpeed's checkpoint-engine
interface (``engine.checkpoint_engine``): DeepSpeed builds its state dicts and file names as
always, and ``save`` takes a snapshot of each one on the training thread (every tensor storage
copied once, views rebuilt on the copy, so storage sharing and the files' bytes are those of
``torch.save`` of the live state; on a GPU the copy goes to pinned host memory with
``non_blocking`` and the writer waits on a CUDA event, so the training thread never syncs), then
one background thread per rank writes each snapshot and ``fsync``s it.

:class:`Saver` keeps at most one save in flight. ``COMPLETE`` (the verification marker,
``pretrain.checkpointing.rundir.marker``) is written only after every rank's writer has finished and synced
its files: the ranks agree on that at sync points (:meth:`Saver.poll`, one tiny all-reduce) or
wait for it (:meth:`Saver.wait`: before the next save, at the end of the run, on a stop). Rank 0's
writer then checksums the files and writes the marker, still off the training thread. A crash
or ``kill -9`` before that leaves the previous checkpoint as the newest complete one.
"""
from __future__ import annotations

import errno
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

try:  # the interface DeepSpeed's engine calls; a plain base keeps this importable without it
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
except ImportError:  # pragma: no cover
    CheckpointEngine = object


def _copy_storage(t: torch.Tensor, copies: dict, events: list, pool: Optional[list] = None) -> torch.Tensor:
    """``t`` rebuilt on a private copy of its storage (one copy per storage, shared by its views).
    ``pool``: host buffers of the previous snapshot of the same file, in order of first use; a
    buffer of the right size is copied into instead of allocating (fresh memory costs a page fault
    per 4 KiB, which made up most of a snapshot's time)."""
    src = t.untyped_storage()
    key = (src.data_ptr(), src.device)
    dst = copies.get(key)
    if dst is None:
        raw = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)
        index = len(copies)
        reuse = pool[index] if pool is not None and index < len(pool) else None
        if reuse is not None and reuse.nbytes() != raw.numel():
            reuse = None
        cuda = src.device.type == "cuda"
        if reuse is not None:
            host = torch.empty(0, dtype=torch.uint8).set_(reuse)
        else:
            host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=cuda)
        host.copy_(raw, non_blocking=cuda)
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
        dst = copies[key] = host.untyped_storage()
        if pool is not None:
            if index < len(pool):
                pool[index] = dst
            else:
                pool.append(dst)
    out = torch.empty(0, dtype=t.dtype)
    out.set_(dst, t.storage_offset(), t.size(), t.stride())
    out.requires_grad_(False)
    return out


def snapshot(obj: Any, copies: Optional[dict] = None, events: Optional[list] = None,
             memo: Optional[dict] = None, pool: Optional[list] = None) -> Any:
    """A copy of a state dict that later in-place updates of the live tensors do not reach:
    containers copied, tensors on private storages, other leaves (ints, strings, configs) shared.
    An object met twice is copied once (``memo``), so pickle writes the same references."""
    copies = {} if copies is None else copies
    events = [] if events is None else events
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)][1]
    if isinstance(obj, torch.Tensor):
        out = _copy_storage(obj.detach(), copies, events, pool)
        if isinstance(obj, torch.nn.Parameter):  # pickled as a Parameter, with its flag
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        elif obj.requires_grad:
            out.requires_grad_(True)
    elif isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        memo[id(obj)] = (obj, out)
        for k, v in obj.items():
            out[k] = snapshot(v, copies, events, memo, pool)
        if getattr(obj, "__dict__", None):  # a module state dict's _metadata (versions), pickled with it
            out.__dict__.update(obj.__dict__)
    elif isinstance(obj, list):
        out = []
        memo[id(obj)] = (obj, out)
        out.extend(snapshot(v, copies, events, memo, pool) for v in obj)
    elif type(obj) is tuple:  # torch.Size and named tuples are immutable: shared as they are
        out = tuple(snapshot(v, copies, events, memo, pool) for v in obj)
    else:
        return obj
    memo[id(obj)] = (obj, out)  # the original is kept alive so its id is not reused meanwhile
    return out


class SnapshotEngine(CheckpointEngine):
    """DeepSpeed checkpoint engine: snapshot on the caller's thread, write on one background
    thread (``torch.save`` + ``fsync``), in order. ``wait`` returns when all queued work is
    durable; the first error of the writer is raised there (and by ``error``)."""

    def __init__(self, on_written: Optional[Callable[[str], None]] = None):
        self.name = "vitscale-snapshot"
        self._jobs: queue.Queue = queue.Queue()
        self._pools: dict[str, list] = {}  # file name -> host buffers of its last snapshot
        self._error: Optional[BaseException] = None
        self._on_written = on_written
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    # --- DeepSpeed's interface
    def create(self, info) -> None:
        pass

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        """Snapshot now, write later. The host buffers of this file's previous snapshot are reused:
        the caller (``Saver``) starts a save only after the writer finished the previous one."""
        # by name, as DeepSpeed's engine: torch names the zip's root after it
        self.save_with(state_dict, path, torch.save)

    def save_with(self, obj, path: str, write: Callable[[Any, str], None]) -> None:
        """:meth:`save` for a file of another format: ``write(snapshot, path)`` on the writer."""
        events: list = []
        pool = self._pools.setdefault(os.path.basename(path), [])
        snap = snapshot(obj, {}, events, None, pool)
        self._jobs.put((self._write, (snap, path, events, write)))

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return True

    def is_decoupled(self) -> bool:
        return False

    def get_commit_info(self):
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        return True

    # --- ours
    def submit(self, fn: Callable, *args) -> None:
        """Any other work that must follow the queued writes (small files, the marker)."""
        self._jobs.put((fn, args))

    def idle(self) -> bool:
        return self._jobs.unfinished_tasks == 0

    def wait(self) -> None:
        self._jobs.join()
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def _write(self, snap, path: str, events: list, write: Callable[[Any, str], None]) -> None:
        for ev in events:  # the device-to-host copies of this snapshot
            ev.synchronize()
        write(snap, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if self._on_written is not None:
            self._on_written(path)

    def _run(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                if self._error is None:  # after a failure the rest of that save is skipped
                    fn(*args)
            except BaseException as e:  # noqa: BLE001  handed to the training thread at wait/poll
                self._error = e
            finally:
                self._jobs.task_done()

    def clear_error(self) -> None:
        self._error = None


class Saver:
    """At most one asynchronous save per rank in flight, completed collectively.

    ``start`` is called by every rank at the same step (``checkpoint.save_async``); ``poll`` at
    sync points completes the save when every rank's writer is done, without waiting; ``wait``
    completes it however long the writes take (before the next save, at the end, on a stop)."""

    def __init__(self, engine, rank: int, finish: Callable[[int, Path], None]):
        self.writer = SnapshotEngine()
        engine.checkpoint_engine = self.writer
        self.rank, self._finish = rank, finish
        self.pending: Optional[tuple[int, Path]] = None
        self.last_completed: Optional[int] = None
        self.failed: Optional[int] = None  # the step of the save that failed, once agreed
        self.waited_s = 0.0  # training-thread seconds spent waiting for writes to finish

    def start(self, step: int, path: Path) -> None:
        self.pending = (step, path)

    def _agree(self, mine: int) -> int:
        """The minimum over ranks of 1 (done), 0 (writing), -1 (failed): one int all-reduce."""
        import torch.distributed as dist

        flag = torch.tensor([mine], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return int(flag.item())

    def _state(self) -> int:
        if self.writer.error is not None:
            return -1
        return 1 if self.writer.idle() else 0

    def poll(self) -> bool:
        """Complete the pending save if every rank has written it; True when nothing is pending."""
        if self.pending is None:
            return True
        agreed = self._agree(self._state())
        if agreed == 0:
            return False
        return self._complete(agreed)

    def wait(self) -> None:
        if self.pending is None:
            return
        t0 = time.perf_counter()
        try:
            self.writer.wait()
        except BaseException:  # noqa: BLE001  every rank learns of it in the agreement below
            pass
        self.waited_s += time.perf_counter() - t0
        self._complete(self._agree(self._state()))

    def _complete(self, agreed: int) -> bool:
        step, path = self.pending
        self.pending = None
        if agreed < 0:  # this rank's own error (torch.save's RuntimeError on a full disk), or a peer's
            err = self.writer.error
            self.writer.clear_error()
            self.failed = step
            raise err if err is not None else OSError(errno.EIO, f"another rank failed to write {path}")
        if self.rank == 0:
            self.writer.submit(self._finish, step, path)
        self.last_completed = step
        return True

    def close(self) -> None:
        """Wait for everything (the marker included) to be on disk."""
        self.wait()
        self.writer.wait()
