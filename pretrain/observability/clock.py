"""Honest clocks: every timed region ends by waiting for the device, then reads the time.

On a GPU the host queues kernels and runs ahead; a clock read on the host right after the last
call of a window measures how fast the host *queued* work, not how fast the device did it, and
img/s and MFU come out high. ``synced_now`` is the one function that orders the two: it waits
until the device has finished everything queued on it, then reads ``time.perf_counter``.
Training windows, the in-training evaluation and the benchmarks read their clocks through it.

Cost: one device synchronisation per call (a sync point); call it at the ends of windows, not
inside steps.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Union

import torch

Device = Union[torch.device, str, int, None]


def device_sync(device: Device) -> None:
    """Wait until ``device`` has finished all queued work (a no-op on the CPU, which runs
    synchronously)."""
    dev = torch.device(device) if device is not None and not isinstance(device, torch.device) else device
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)


def synced_now(device: Device, *, sync: Callable[[Device], None] = device_sync,
               clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds on ``clock``, read only after ``sync(device)`` returned. ``sync`` and ``clock`` are
    parameters so that a test can check the order on a machine without a GPU."""
    sync(device)
    return clock()


# A training step's phases, in order. ``gather``: under ZeRO-3, the forward's waits for parameters
# (each submodule's all-gather, and with it the peers it waits on); the rest of the forward is the
# rank's own work.
PHASES = ("data", "forward", "gather", "agree", "backward", "step")
# Not phases: the seconds of ``backward`` and of ``step`` this rank spent inside collectives (waiting
# for its peers, then moving the bytes), timed on the host where collectives block it (the CPU; 0 on
# a GPU, where NCCL runs them on its own streams). ``close_window`` reports them beside the phases.
WAITED = {"backward": "backward_waited", "step": "step_waited"}
# Not phases either: the seconds of each phase, outside its timed collectives, this rank was ready to
# run but waited for a core (the kernel's run queue), where the host clock times the phases (the CPU;
# 0 on a GPU). On cores shared by more processes than they hold, which process waits is the
# scheduler's chance, and it is most of a phase's seconds (a busy loop on two cores shared by five
# jobs ran 29 % of the wall time): ``pretrain.resilience.straggler`` shares it out per host.
QUEUED = {p: f"{p}_queued" for p in PHASES}
CLOCKED = PHASES + tuple(WAITED.values()) + tuple(QUEUED.values())


def run_queue_clock() -> Optional[Callable[[], float]]:
    """A function returning the seconds the calling thread has so far spent runnable but not running
    (waiting on a run queue for a core), read from Linux's ``/proc/thread-self/schedstat`` (its second
    field, nanoseconds); None where the kernel keeps no such count. The file is opened once, by the
    thread the returned function measures. Cost: one ``pread`` of a proc file, about 2 us."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return lambda: int(os.pread(fd, 128, 0).split()[1]) * 1e-9


class StepClock:
    """Phase boundaries of the training step and the logging window's clock, in one place.

    ``enter(phase)`` is where a step moves on: it beats the hang watchdog and closes the previous
    phase's timing. The data phase (the host blocked on the loader) is timed on the host clock;
    device phases with CUDA events on a GPU (recorded in the stream, read only after the window's
    sync, so no host sync inside a step) and with the host clock on the CPU, which runs
    synchronously. ``close_window()`` is the window's one sync point: ``synced_now``, then the
    events are read; it returns the window's seconds and the seconds of each phase on this rank."""

    def __init__(self, device, dog=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dog = dog
        self.step, self.startup, self.completed = 0, False, 0
        self._phase, self._t, self._event = None, 0.0, None
        self._pending: list = []  # CUDA: (phase, start event, end event), read at close_window
        self.t0 = synced_now(self.device)
        self.totals = dict.fromkeys(CLOCKED, 0.0)
        self._depth, self._w, self._wphase = 0, 0.0, None  # collectives in progress (nested: once), since when
        # run-queue seconds: on the host-timed phases of a host-synchronous device only
        self._queue = None if self.cuda else run_queue_clock()
        self._q, self._wq, self._q_in_comm = 0.0, 0.0, 0.0  # at the phase's start, the collective's, inside them

    def begin_step(self, step: int, startup: bool = False) -> None:
        """Phases from here on belong to ``step``; ``startup``: the watchdog allows start-up's
        bound (the first step after a start or resume: first collectives, JIT builds)."""
        self.step, self.startup = step, startup

    def end_step(self) -> None:
        """``step`` is done (the last step reached, for status.json after a failure)."""
        self._close()
        self.completed = self.step

    def gather_begin(self) -> None:
        """ZeRO-3 starts fetching a submodule's parameters inside the forward: the time until
        ``gather_end`` (the all-gather, and the wait for the slowest peer to join it) counts as
        ``gather``, not as this rank's forward. Outside the forward (an activation-checkpointing
        recompute in backward, an evaluation) it changes nothing."""
        if self._phase == "forward":
            self.enter("gather")

    def gather_end(self) -> None:
        if self._phase == "gather":
            self.enter("forward")

    def comm_begin(self) -> None:
        """A collective begins (``ds_compat.time_collectives``): inside ``backward`` or ``step`` on a
        host-synchronous device, its seconds until ``comm_end`` count as ``waited``: time the rank
        did not spend on its own work. Elsewhere (the forward's ``gather`` and ``agree`` are waits
        as a whole) and on a GPU it changes nothing."""
        self._depth += 1
        if self._depth == 1 and self.times_waits and self._phase in WAITED:
            self._w, self._wphase = time.perf_counter(), self._phase
            if self._queue is not None:
                self._wq = self._queue()

    def comm_end(self) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and self._wphase is not None:
            self.totals[WAITED[self._wphase]] += time.perf_counter() - self._w
            if self._queue is not None:
                self._q_in_comm += self._queue() - self._wq
            self._wphase = None

    @property
    def times_waits(self) -> bool:
        """Whether ``comm_begin``/``comm_end`` time collectives: only where they block the host."""
        return not self.cuda

    def beat(self, phase: str, slow: bool = False) -> None:
        """A watchdog beat outside the step's phases (log, eval, checkpoint, stop); ``slow``: the
        watchdog's longer allowance (evaluation, checkpoint writes)."""
        self._close()
        if self.dog is not None:
            self.dog.beat(self.step, phase, slow=slow, startup=self.startup)

    def enter(self, phase: str) -> None:
        self.beat(phase)
        self._phase = phase
        if self.cuda and phase != "data":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._t = time.perf_counter()
            if self._queue is not None:
                self._q, self._q_in_comm = self._queue(), 0.0

    def _close(self) -> None:
        if self._phase is None:
            return
        if self._event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._phase, self._event, end))
            self._event = None
        else:
            self.totals[self._phase] += time.perf_counter() - self._t
            if self._queue is not None:
                self.totals[QUEUED[self._phase]] += self._queue() - self._q - self._q_in_comm
        self._phase = None

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation, say) out of the current window."""
        self.t0 += seconds

    def close_window(self) -> tuple[float, dict]:
        """(seconds since the window began, {``CLOCKED`` key: seconds on this rank}); starts the next
        window.
        A sync point: the device finishes the window's work before any clock is read."""
        self._close()
        now = synced_now(self.device)
        for phase, start, end in self._pending:  # complete: recorded before the sync
            self.totals[phase] += start.elapsed_time(end) / 1000.0
        self._pending.clear()
        elapsed, phases = max(now - self.t0, 1e-9), self.totals
        self.t0, self.totals = now, dict.fromkeys(CLOCKED, 0.0)
        return elapsed, phases
