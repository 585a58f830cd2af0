"""Chosen training steps recorded with ``torch.profiler`` (``logging.profile``).

    logging:
      profile: {start_step: 20, steps: 2, ranks: [0]}

Steps ``start_step`` to ``start_step + steps - 1`` of each listed rank run under
``torch.profiler.profile``: every torch op on the host and, on a GPU, every kernel and copy on the
device. The device finishes its queued work before the first of those steps and after the last
(two sync points), so the trace holds those steps and nothing of their neighbours. Each step is
marked ``vit-train step N`` in the trace. Under ``<output_dir>/profile/steps-S-E/``:

    rank-R.json.gz   the Chrome trace (Perfetto, chrome://tracing, TensorBoard's profiler)
    rank-R.txt       torch's table of the ops, by their own device time (CPU time on a CPU)
    rank-R.json      the summary: wall time per step, the share of it the device was busy (any
                     kernel or copy running, on any stream; on a CPU: any torch op running), the
                     attention kernel ``scaled_dot_product_attention`` dispatched to, the top ops

and one line on the rank's stderr. The busy share is what tells a step the GPU waits in (the host
not queueing work fast enough, a transfer, a sync) from one it spends computing.

The profiler slows the steps it records: the logging window that holds any of them carries
``profiled_steps`` in its metrics (``metrics.jsonl``, W&B; with rank 0's ``profile/ms_per_step`` and
``profile/busy_share`` where rank 0 records) and is no evidence for the straggler
check (every rank knows which windows from the config), and the seconds spent starting the
profiler and writing its files are left out of the window's clock.
"""
from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from pretrain.observability.clock import device_sync
from pretrain.observability.config import ProfileConfig

TOP = 12  # ops in the summary


def profiled_steps(cfg: ProfileConfig, first: int, last: int) -> int:
    """How many of steps ``first``..``last`` the config records (on the ranks it names)."""
    if not cfg.start_step:
        return 0
    end = cfg.start_step + cfg.steps - 1
    return max(0, min(last, end) - max(first, cfg.start_step) + 1)


def busy_share(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """The share of ``[start, end]`` covered by at least one of ``intervals`` (overlaps counted once:
    kernels on several streams, nested ops)."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= reach:
            continue
        covered += b - max(a, reach)
        reach = b
    return covered / (end - start)


# the Chrome trace's categories of work on the device (kernels and copies on any stream; not
# ``gpu_user_annotation``, the device-side span of a ``record_function`` range) and, on a CPU, of torch ops
DEVICE_WORK = {"cuda": ("kernel", "gpu_memcpy", "gpu_memset"), "cpu": ("cpu_op",)}
STEP_MARK = "vit-train step "


def summarize(trace: dict, averages, device_type: str, top: int = TOP) -> dict:
    """What a Chrome trace of marked steps (``trace``: its JSON) and torch's op averages over them
    say: the steps' span (from the first step mark's start to the last mark's end or the last
    device work's end, whichever is later: the device finishes after the host has queued), the
    share of it the device was busy (``DEVICE_WORK``), the attention kernel chosen, and the ``top``
    ops by their own time on that device, in ms per step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    marks = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_MARK)]
    if not marks:
        raise ValueError("no step marks in the trace")
    work = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
            if e.get("cat") in DEVICE_WORK[device_type]]
    t0 = min(float(e["ts"]) for e in marks)
    t1 = max([float(e["ts"]) + float(e["dur"]) for e in marks] + [b for _, b in work])
    steps = len(marks)
    key = time_key(device_type)
    ranked = sorted((e for e in averages if getattr(e, key, 0.0) > 0 and not e.key.startswith(STEP_MARK)),
                    key=lambda e: getattr(e, key), reverse=True)
    return {"steps": steps, "time": "device" if device_type == "cuda" else "cpu",
            "ms_per_step": (t1 - t0) / 1e3 / steps, "busy_share": busy_share(work, t0, t1),
            "attention": sorted({e.key for e in averages if e.key.startswith("aten::_scaled_dot_product_")}),
            "top": [{"name": e.key[:100], "calls": e.count, "ms_per_step": getattr(e, key) / 1e3 / steps}
                    for e in ranked[:top]]}


def time_key(device_type: str) -> str:
    """The field of torch's op averages that holds an op's own time on ``device_type``."""
    return "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"


def exported_summary(prof, trace: Path, averages, device_type: str) -> dict:
    """``prof``'s Chrome trace written to ``trace`` (gzipped where it ends in ``.gz``), read back and
    :func:`summarize`d with ``averages`` (``prof.key_averages()``)."""
    prof.export_chrome_trace(str(trace))
    with (gzip.open if trace.suffix == ".gz" else open)(trace, "rt") as f:
        return summarize(json.load(f), averages, device_type)


def summary_line(s: dict) -> str:
    what = "device busy" if s["time"] == "device" else "in torch ops"
    top = ", ".join(f"{t['name']} {t['ms_per_step']:.1f} ms" for t in s["top"][:4])
    return (f"{s['ms_per_step']:.1f} ms a step, {what} {s['busy_share']:.0%} of it; most {s['time']} time: {top}")


class StepProfiler:
    """``before(step)`` ahead of each step, ``after(step)`` once it is done, ``close(step)`` when the
    loop ends; all do nothing outside the recorded steps and on ranks that do not record. A profiler
    that cannot start, or a trace that cannot be written, is one line and the run goes on. A run that
    resumes inside the configured steps records those it takes; one that stops inside them writes
    what it recorded at ``close``. Each returns the seconds the profiler itself took (starting,
    stopping, writing), which the caller leaves out of the window's clock."""

    def __init__(self, cfg: ProfileConfig, rank: int, root: Path, device, records: bool = True,
                 beat: Callable[[], None] = lambda: None, run_steps: Optional[int] = None):
        self.cfg, self.rank, self.device, self.records, self.beat = cfg, rank, torch.device(device), records, beat
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        if run_steps is not None:
            self.last = min(self.last, run_steps)
        self.root = root / "profile"
        self.prof, self.mark, self.started = None, None, 0
        self.written: Optional[dict] = None  # the last summary, until the window's metrics take it

    @classmethod
    def of(cls, cfg: ProfileConfig, *, rank: int, world: int, start_step: int, steps: int, root: Path, device,
           say: Callable[[str], None], beat: Callable[[], None] = lambda: None) -> Optional["StepProfiler"]:
        """The job's profiler on this rank (``records`` where the config names it), or None where the
        job records nothing; ``say`` (rank 0's start-up lines) tells when the config names no step
        this run takes or no rank it has; ``beat`` (the hang watchdog's longer allowance) comes
        before the files are written."""
        if not cfg.start_step:
            return None
        ranks = cfg.ranks or list(range(world))
        if not any(r < world for r in ranks):
            say(f"logging.profile.ranks={cfg.ranks}: no such rank in a world of {world}: nothing is profiled")
            return None
        if not profiled_steps(cfg, start_step + 1, steps):
            say(f"logging.profile.start_step={cfg.start_step}: outside the steps this run takes "
                f"({start_step + 1}-{steps}): nothing is profiled")
            return None
        return cls(cfg, rank, root, device, records=rank in ranks, beat=beat, run_steps=steps)

    def window_steps(self, first: int, last: int) -> int:
        """How many of the window's steps ``first``..``last`` the job records."""
        return profiled_steps(self.cfg, first, last)

    def metrics(self) -> dict:
        """This rank's summary written since the last call, as window metrics (``profile/*``)."""
        s, self.written = self.written, None
        return {} if s is None else {"profile/ms_per_step": s["ms_per_step"], "profile/busy_share": s["busy_share"]}

    def before(self, step: int) -> float:
        if not self.records or not self.first <= step <= self.last:
            return 0.0
        t = time.perf_counter()
        if self.prof is None:  # the first recorded step this run takes
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            device_sync(self.device)  # the previous steps' work done: none of it in the trace
            try:
                self.prof, self.started = profile(activities=acts), step
                self.prof.start()
            except Exception as e:  # noqa: BLE001  (a diagnostic never ends the run)
                self._given_up(f"could not start at step {step}", e)
                return time.perf_counter() - t
        self.mark = torch.autograd.profiler.record_function(f"{STEP_MARK}{step}")
        self.mark.__enter__()
        return time.perf_counter() - t

    def after(self, step: int) -> float:
        if self.mark is None:
            return 0.0
        self.mark.__exit__(None, None, None)
        self.mark = None
        return self._write(step) if step >= self.last else 0.0

    def close(self, step: int) -> float:
        """The loop ended (a stop agreed between ranks) with steps still to record: what was recorded,
        written."""
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        return self._write(step) if self.prof is not None else 0.0

    def _write(self, step: int) -> float:
        device_sync(self.device)  # every kernel of the last step in the trace
        t = time.perf_counter()
        self.beat()
        try:
            self._export(step)
        except Exception as e:  # noqa: BLE001  (a diagnostic never ends the run)
            self._given_up(f"steps {self.started}-{step}", e)
        self.prof = None
        return time.perf_counter() - t

    def _given_up(self, what: str, e: Exception) -> None:
        """One line, and no more recording on this rank: the run goes on."""
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"vit-train: rank {self.rank}: logging.profile {what}: {type(e).__name__}: {first}; training goes "
              f"on without it", file=sys.stderr, flush=True)
        self.records, self.prof = False, None

    def _export(self, step: int) -> None:
        self.prof.stop()
        folder = self.root / f"steps-{self.started}-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank-{self.rank}.json.gz"
        averages = self.prof.key_averages()
        s = exported_summary(self.prof, trace, averages, self.device.type)
        (folder / f"rank-{self.rank}.txt").write_text(averages.table(sort_by=time_key(self.device.type), row_limit=40))
        (folder / f"rank-{self.rank}.json").write_text(json.dumps({"rank": self.rank, **s}, indent=1) + "\n")
        print(f"vit-train: rank {self.rank} profiled steps {self.started}-{step}: {summary_line(s)}; "
              f"trace {trace}", file=sys.stderr, flush=True)
        self.written = s
