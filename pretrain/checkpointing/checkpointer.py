"""The Checkpointer: the loop calls it every step and it decides itself whether this step saves."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from data_pipeline.loading.loader_state import LoaderState
from data_pipeline.loading.sample_log import SampleLog
from pretrain.checkpointing import checkpoint
from pretrain.checkpointing.async_save import Saver
from pretrain.config import Config


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (one line: the folder, why, the last good checkpoint)."""


class Checkpointer:
    """Decides at each step whether it saves (``train.steps``, ``checkpoint.every_steps``, a stop)
    and writes the checkpoint with the loader position, so the loop only calls ``maybe_save``.
    With ``checkpoint.async`` the files are written in the background (``pretrain/checkpointing/async_save.py``):
    a save in flight is completed at sync points when every rank has written it, and waited for
    before the next save, on a stop and at the end (``close``)."""

    def __init__(self, cfg: Config, engine, loader, ckpt_dir: Path, run_info: dict, logger,
                 samples: Optional[SampleLog], ema=None, totals: Callable[[], dict] = dict):
        self.every, self.last, self.keep = cfg.checkpoint.every_steps, cfg.train.steps, cfg.checkpoint.keep_last
        self.engine, self.loader, self.dir, self.run_info, self.ema = engine, loader, ckpt_dir, run_info, ema
        self.logger, self.samples = logger, samples
        self.totals = totals  # what the run has done and cost up to now, into each run.json
        self.saver = None
        if cfg.checkpoint.async_save:
            self.saver = Saver(engine, dist.get_rank(), checkpoint.finish_async(self.keep))
        self.blocked_s: list[float] = []  # seconds each save held the training thread
        self.waited_s: list[float] = []  # of which waiting for the previous asynchronous save
        self.saved_totals: Optional[dict] = None  # the totals the newest save of this invocation holds

    @staticmethod
    def loader_states(rank_states: list, kind=LoaderState) -> list:
        """The loader states (``kind``: ``LoaderState``, or the synthetic loader's) of the per-rank
        states ``checkpoint.resume`` returns, as :meth:`maybe_save` stored them; ``DataError`` in one
        line for a state this loader cannot continue (an old version, another kind of loader)."""
        return [kind.from_dict(st["loader"]) for st in rank_states]

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last

    def maybe_save(self, step: int, stopping: bool = False, sync: bool = False) -> float:
        """Save when ``step`` is due (or the run stops); the seconds the save held this thread, 0 when
        nothing was saved."""
        saving = stopping or self.due(step)
        try:
            if self.saver is not None and sync and not saving:
                self.saver.poll()  # a sync point: complete the save in flight if every rank wrote it
            if not saving:
                return 0.0
            if self.samples is not None:
                self.samples.flush()
            t0 = time.perf_counter()
            totals = self.totals()
            state = dict(rank_state={"loader": self.loader.state().to_dict()},
                         run_info={**self.run_info, "wandb_run_id": self.logger.run_id, **totals}, ema=self.ema)
            if self.saver is None:
                checkpoint.save(self.engine, self.dir, step, keep_last=self.keep, **state)
            else:
                waited = self.saver.waited_s
                checkpoint.save_async(self.engine, self.saver, self.dir, step, **state)
                if stopping or step == self.last:
                    self.saver.close()
                self.waited_s.append(self.saver.waited_s - waited)
            self.saved_totals = totals
            self.blocked_s.append(time.perf_counter() - t0)
            return self.blocked_s[-1]
        except (OSError, RuntimeError) as e:
            self._failed(step, e)

    def close(self) -> None:
        """The save in flight, if any, complete and on disk (collective)."""
        if self.saver is None:
            return
        step = self.saver.pending[0] if self.saver.pending else 0
        try:
            self.saver.close()
        except (OSError, RuntimeError) as e:
            self._failed(step, e)

    def _failed(self, step: int, e: BaseException) -> None:
        """A save that could not be written (folder made read-only, disk full; torch.save's writer
        says so with a RuntimeError, also on the background thread): one line saying what survives,
        not a traceback. Other errors go on unchanged. A background write's failure is learnt at a
        later sync point or save: the line names that write's checkpoint, not ``step``."""
        if self.saver is not None and self.saver.failed is not None:
            step, self.saver.failed = self.saver.failed, None
        err = e if isinstance(e, OSError) else checkpoint.as_os_error(e, self.dir / checkpoint.tag_for(step))
        if not isinstance(err, OSError):
            raise e
        raise CheckpointWriteError(checkpoint.save_failed(self.dir, step, err)) from None
