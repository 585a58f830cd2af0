"""``data.record_samples``: which samples each rank consumed, one line per sample.

``<dir>/rank-<R>.tsv`` holds ``step<TAB>epoch<TAB>key`` lines (``key`` is the sample's WebDataset
``__key__``), appended across resumes. A run that resumes from a checkpoint at step ``S`` first
cuts the file back to the lines of steps ``<= S`` (those after it will be trained again), so the
file always tells which images the run's current history saw, in order. The loop calls::

    log = SampleLog(out_dir / "samples", rank)
    log.open(resume_step)                            # 0 for a fresh run
    log.write(step, loader.last_epoch, loader.last_keys)   # after each micro batch of step ``step``
    log.flush()                                      # at checkpoint time (lines up to that step on disk)
    log.close()

Lines are buffered and written at ``flush`` (or when the buffer grows past ``flush_every`` lines),
so a crash loses at most the lines since the last flush, which a resume from that checkpoint would
cut anyway.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional


class SampleLog:
    def __init__(self, directory, rank: int, flush_every: int = 65536):
        self.path = Path(directory) / f"rank-{rank:d}.tsv"
        self.flush_every = flush_every
        self._lines: list[str] = []
        self._file = None

    def open(self, resume_step: int = 0) -> "SampleLog":
        """Keep only the lines of steps ``<= resume_step`` (atomically: temp file + rename), then
        append from there."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
            with open(self.path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
                for line in src:
                    head = line.split("\t", 1)[0]
                    if line.endswith("\n") and head.isdigit() and int(head) <= resume_step:
                        dst.write(line)  # a torn last line (crash mid-write) is dropped too
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def write(self, step: int, epoch: int, keys) -> None:
        self._lines.extend(f"{step}\t{epoch}\t{key}\n" for key in keys)
        if len(self._lines) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._file is None:
            raise RuntimeError("SampleLog.open() first")
        self._file.write("".join(self._lines))
        self._lines.clear()
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, flush: bool = True) -> None:
        """``flush=False`` drops the lines not yet written (a failed run: a resume cuts them anyway)."""
        if self._file is not None:
            if flush:
                self.flush()
            self._lines.clear()
            self._file.close()
            self._file = None


def logged_batches(loader, samples: Optional[SampleLog], start_step: int, accumulation: int,
                   batches: Optional[Iterator] = None) -> Iterator:
    """The loader's batches (``batches``: a stream of them, e.g. resized by step, which the loader's
    ``last_keys`` follow); with ``data.record_samples`` each batch's keys are logged at its step
    (``accumulation``: loader batches per step)."""
    for i, batch in enumerate(loader if batches is None else batches):
        if samples is not None:
            samples.write(start_step + 1 + i // accumulation, loader.last_epoch, loader.last_keys)
        yield batch
