"""A logging window: what the loop sums on the device between sync points, and the metrics of the
window at a log step (the one place the loop reads the device and the clock together)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from pretrain.config.phases import Phase, phase_at, steps_by_phase
from pretrain.observability.clock import PHASES, StepClock
from pretrain.observability.flops import peak_tflops
from pretrain.observability.metrics import peak_memory_gb, throughput


@dataclass
class RunTotals:
    """What the run has done up to the loop's step, over every invocation (each checkpoint's
    ``run.json`` carries them on): images of all ranks, and their model FLOPs counted as the
    windows count them (each step at its resolution and kept tokens); and the device-seconds of the
    invocations before this one that led to it. FLOPs and device-seconds are None once the run
    resumed a checkpoint that did not carry them (an older release's): a count from that resume on
    would read as the whole run's. ``spent_before``: what every earlier invocation of the run
    spent, the work that failures lost included (``status.json``'s, not the checkpoint's).
    ``started`` and ``world``: this invocation's (``begin``), whose device time ``record`` and
    ``spent`` add."""
    images: int = 0
    model_flops: Optional[float] = 0.0
    device_seconds: Optional[float] = 0.0
    spent_before: float = 0.0
    started: float = 0.0
    world: int = 0
    target_reached: Optional[dict] = None  # when validation.target_metric was first reached (evaluation.target)

    def carry(self, info: dict) -> None:
        """Carry on the totals of the checkpoint resumed (its ``run.json``); one of an older release:
        its images from its own global batch, its FLOPs and device time unknown."""
        batch = int(((info.get("config") or {}).get("train") or {}).get("global_batch_size") or 0)
        self.images = int(info.get("images_seen", info["step"] * batch))
        secs = info.get("device_seconds")
        self.model_flops, self.device_seconds = info.get("model_flops"), None if secs is None else float(secs)
        self.target_reached = info.get("target_reached")

    def begin(self, started: float, world: int, spent_before: float = 0.0) -> None:
        """This invocation: ``time.time()`` as it began, its ranks, and what the ones before it spent."""
        self.started, self.world, self.spent_before = started, world, spent_before

    def add(self, images: int, flops_per_image: float) -> None:
        self.images += images
        if self.model_flops is not None:
            self.model_flops += images * flops_per_image

    def record(self, own: bool = True) -> dict:
        """As ``run.json`` and ``summary.json`` hold them, now: ``device_seconds`` adds this
        invocation's ranks since it began (start-up, saves and evaluations included; the time an
        invocation spent past its last checkpoint before a crash is not in the checkpoint it
        resumes). ``own=False``: without them, for an invocation that led to no checkpoint (it
        trained no step): its time is in ``spent`` alone."""
        secs = None if self.device_seconds is None else round(self.device_seconds + own * self._own(), 3)
        return {"device_seconds": secs,
                "images_seen": self.images, "model_flops": self.model_flops,
                **({"target_reached": self.target_reached} if self.target_reached is not None else {})}

    def spent(self) -> float:
        """The run's device-seconds so far, every invocation's, lost work included."""
        return self.spent_before + self._own()

    def _own(self) -> float:
        return (time.time() - self.started) * self.world


class Forecast:
    """How long the steps left will take, at the pace of the resolution phase running: the
    wall-clock from the end of its first step in this invocation (start-up and a new shape's
    compile not counted; evaluations and checkpoint saves are) over the model FLOPs of its steps
    done since, times the model FLOPs of the steps left. A step is weighed by its phase's FLOPs per
    image (the global batch is the same in every phase), so a later phase at more pixels counts as
    dearer. A phase with no step past its first yet goes at the last pace measured: a larger
    resolution usually runs at a higher MFU, so before such a phase has a second step the forecast
    runs high."""

    def __init__(self, phases: list[Phase], flops: dict[int, tuple[float, float]], steps: int):
        self.phases, self.steps = phases, steps
        self.cost = {p: flops[p.img_size][0] for p in phases}  # model FLOPs per image of each phase
        self.marks: dict[Phase, tuple[int, float]] = {}  # phase -> (step, time) its pace counts from
        self.pace: Optional[float] = None  # seconds per model FLOP per image, the last measured

    def start(self, step: int, now: Optional[float] = None) -> None:
        """``step`` is done: this invocation's first, or a phase's first (its shape's warm-up and
        compile): its phase's pace is measured from here. The clock is read without waiting for
        the device (this need not be a sync point): off by the work it has queued, a step or two."""
        self.marks.setdefault(phase_at(self.phases, step), (step, time.time() if now is None else now))

    def seconds_left(self, step: int, now: Optional[float] = None) -> Optional[float]:
        """Wall-clock seconds to ``train.steps`` after ``step``; None before any phase has a step
        past its first in this invocation. Keeps the pace it measures, for a next phase's first."""
        mark = self.marks.get(phase_at(self.phases, step))
        if mark is not None and step > mark[0]:
            elapsed = (time.time() if now is None else now) - mark[1]
            self.pace = elapsed / self._flops(mark[0], step)
        return None if self.pace is None else self.pace * self._flops(step, self.steps)

    def _flops(self, after: int, upto: int) -> float:
        """The model FLOPs per image summed over steps ``after + 1 .. upto``."""
        return sum(n * self.cost[p] for p, n in steps_by_phase(self.phases, after, upto))

    def note(self, step: int, device_hours: Optional[float], world: int, now: Optional[float] = None) -> str:
        """``eta=3.2h (~205 device-hours in all)`` for the progress line: the time left and the
        run's device-hours at its end at this pace, without another restart (where the hours so
        far are known); empty when the time left is unknown."""
        left = self.seconds_left(step, now)
        if left is None or step >= self.steps:
            return ""
        total = "" if device_hours is None else f" (~{device_hours + left * world / 3600:.3g} device-hours in all)"
        return f"eta={duration(left)}{total}"


def duration(seconds: float) -> str:
    """``45s``, ``1.5m``, ``12m``, ``3.2h``, ``4.1d``: a forecast's precision, not a clock's."""
    if seconds < 90:
        return f"{seconds:.0f}s"
    unit, size = next((u, n) for u, n, upto in (("m", 60, 90 * 60), ("h", 3600, 48 * 3600), ("d", 86400, math.inf))
                      if seconds < upto)
    n = seconds / size
    return f"{n:.2g}{unit}" if n < 10 else f"{n:.0f}{unit}"


class Window:
    """What a logging window sums between sync points: losses (on the device), images, and the
    training FLOPs of those images at their own step's resolution and token count; its steps, how
    many of them were cold (a first step: see ``add``), and the LR its last step used."""

    def __init__(self, device):
        self.loss = torch.zeros(2, device=device)  # (sum of kept losses, their count)
        self.images = 0
        self.flops = [0.0, 0.0]  # (model, hardware) FLOPs of this rank's images
        self.img_size = 0  # the resolution of the window's last step
        self.steps = self.cold_steps = 0
        self.lr: Optional[float] = None

    def add(self, loss: torch.Tensor, images: int, flops: tuple[float, float] = (0.0, 0.0), img_size: int = 0,
            lr: Optional[float] = None, cold: bool = False) -> None:
        """One step: its loss sums, its images, their (model, hardware) training FLOPs per image, the
        LR it stepped with (read before the step: ``engine.step()`` moves the schedule on to the next
        step's), and whether it was cold: the first step of this invocation (the first batch, a
        resumed loader's replay to its position, ``train.compile``'s trace) or of a resolution phase
        (the loader's restart at the new size, the new shape's trace), whose seconds are not the pace."""
        self.loss += loss
        self.images += images
        self.flops = [self.flops[0] + images * flops[0], self.flops[1] + images * flops[1]]
        self.img_size = img_size
        self.steps += 1
        self.cold_steps += int(cold)
        self.lr = lr

    def flops_per_image(self) -> tuple[float, float]:
        """(model, hardware) training FLOPs per image, averaged over the window's images."""
        n = max(1, self.images)
        return self.flops[0] / n, self.flops[1] / n


def window_metrics(engine, window: Window, clock: StepClock, *, world: int, totals: dict,
                   nonfinite_skipped: int, loader) -> tuple[dict, dict]:
    """The log step's metrics (a sync point: the device finishes the window, then the clock is
    read) and this rank's phase seconds of the window. TFLOP/s and MFU count each image at its
    step's resolution and the tokens patch dropout kept (``Window.add``). ``loss``: the mean of the
    window's kept micro-batch losses over every rank (their counts are equal: every rank drops the
    same non-finite micro-batches); ``grad_norm``: the last step's; ``lr``: the LR the last step
    used. ``totals``: the run's so far (``RunTotals.record``), logged as ``examples_seen`` and
    ``device_hours``; ``epoch``: the loader's position after the last step (``epochs_done``): at a
    log step the loader has yielded exactly the steps' batches."""
    elapsed, phases = clock.close_window()
    dist.all_reduce(window.loss)
    total, count = window.loss.tolist()
    gn = engine.get_global_grad_norm()
    metrics = {"loss": total / count if count else None, "lr": window.lr,
               "grad_norm": float(gn) if gn is not None else None, "examples_seen": totals["images_seen"],
               "window_steps": window.steps, "cold_steps": window.cold_steps,
               "data_wait_share": phases["data"] / elapsed, "peak_memory_gb": peak_memory_gb(),
               "nonfinite_skipped": nonfinite_skipped, "img_size": window.img_size,
               **throughput(window.images * world, elapsed, world, *window.flops_per_image(), peak_tflops()),
               **{f"phase_share/{p}": phases[p] / elapsed for p in PHASES},  # rank 0's step-time breakdown
               **{f"data/{k}": v for k, v in sum_counters(loader.counters).items()}}
    if loader.epochs_done is not None:  # data.synthetic has no epochs
        metrics["epoch"] = loader.epochs_done  # the position after the window's last step
    if totals["device_seconds"] is not None:  # unknown past an older release's checkpoint: not logged
        metrics["device_hours"] = totals["device_seconds"] / 3600
    metrics.update(loss_scaling(engine))
    return metrics, phases


def loss_scaling(engine) -> dict:
    """fp16's dynamic loss scaler (DeepSpeed's): the current scale and the steps it skipped on an
    overflow so far. Those steps are the scaler's business, apart from ``nonfinite_skipped`` (the
    non-finite guard's dropped micro-batches); empty in the other precisions."""
    if not engine.fp16_enabled():
        return {}
    return {"loss_scale": float(engine.optimizer.loss_scale), "overflow_skipped_steps": int(engine.skipped_steps)}


def sum_counters(counters: dict) -> dict:
    """Loader counters summed over ranks (an all-gather of a small dict, only at log steps)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(counters))
    total: dict = {}
    for c in gathered:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total
