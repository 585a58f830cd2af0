"""Straggler detection: which rank (and host) is slow, and in which phase.

In synchronous data parallelism every rank's step takes as long as the slowest rank's: the others
wait for it inside collectives. So the whole step time says nothing about *who* is slow; the time
each rank spends on its own work, outside collectives, does. The clock gives two kinds of evidence:

* ``LOCAL`` phases (reading the batch, the forward pass) hold no collective under ZeRO 0-2; under
  ZeRO-3 the forward's parameter all-gathers (where the peers of a slow rank wait for it) are timed
  as their own phase, ``gather`` (``StepClock.gather_begin``, hooked around DeepSpeed's fetch by
  ``ds_compat.around_zero3_fetch``), so ``forward`` stays the rank's own work at every stage.
* Where collectives block the host (the CPU), every collective DeepSpeed issues in ``backward`` and
  ``step`` is timed too (``ds_compat.time_collectives``, the clock's ``WAITED``), so those phases less
  their waits are own work as well: ``OWN``. On a GPU, NCCL runs collectives on its own streams and
  the host cannot see the waits; there the evidence is the local phases alone.

Why the waits matter: a rank slowed in bursts (a noisy neighbour, a GPU that throttles,
SIGSTOP/SIGCONT) loses its time in whichever stretch of work a burst lands in, and its peers wait at
the next collective. With local phases only, a burst that lands in backward's compute is seen by
nobody: its peers' extra time and its own both sit in ``backward``. Worse, a job slowed in bursts
locks onto them: the slow rank resumes, leaves the collective its peers were waiting in, and runs
its (short) local phases first, so bursts land in local phases far less often than their share of
the step (measured on the tiny CPU config: local phases 8-15 % of the step, the slowed rank's local
ratio 1.25 where 2 was due). Own work less waits sees every burst outside a collective.

Where the host clock times the phases (the CPU), a rank's seconds also hold the time it was ready
to run but waited for a core: on cores shared by more processes than they hold (the test machine:
two cores, four ranks and the rest of the suite) that is most of them (0.7 of a rank's own seconds,
measured), and which rank the scheduler makes wait is chance, so an even job's span ratio swung up to
1.4 on it alone. The clock counts it per phase (``QUEUED``, the kernel's run-queue time) and the
evidence shares it out: each rank's own work less its run-queue wait plus the mean wait of its
host's ranks (``shared_queue``). The job's load stays in the ratio (a rank stopped half its time
still shows about 2x), the chance of who waited leaves it (even jobs beside a slowed one: 1.02-1.16). What it
costs: a host loaded harder than the others still shows in its ranks, but one rank crowded out by
its host's other ranks does not (on a GPU, where the device clock times the work, nothing changes).

At each logging window every rank contributes its phase seconds (one small all-gather in the
loop). The verdict rests on evidence summed over a sliding span of the last ``windows`` windows,
not on a streak of single windows: one window's ratio swings with where its bursts fell. A rank that
runs only a fraction ``1 - s`` of the time has own seconds about ``1 / (1 - s)`` times its peers'
(a rank slowed 40 % shows 1.67x, half the time 2x), and an even job's noise shrinks over the span.
A rank whose own seconds summed over a full span exceed the median of the *other* ranks' sums by
``factor`` is named once, with the phase where it lost most time against the median of that phase
over the span (``rank 1 on node7: 1.8x the median step, mostly in forward``); it is named again only
after its span ratio fell below half-way to the factor (recovered) and rose to it again.

What no phase time shows: a burst that lands while the slow rank is itself inside a collective
makes its peers wait in the same collective exactly as long, so it leaves no trace on anyone.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pretrain.observability.clock import CLOCKED, PHASES, QUEUED, WAITED

LOCAL = ("data", "forward")
OWN = LOCAL + tuple(WAITED)  # backward and step less their waits, where collectives are timed


def own_phase(p: dict, phase: str, waits_timed: bool) -> float:
    """Rank's own work in ``phase`` of phase seconds ``p`` (0 for a phase that is no evidence)."""
    if phase in LOCAL:
        return p.get(phase, 0.0)
    if waits_timed and phase in WAITED:
        return p.get(phase, 0.0) - p.get(WAITED[phase], 0.0)
    return 0.0


def own_seconds(p: dict, waits_timed: bool) -> float:
    """A rank's own work in phase seconds ``p``: the local phases, and where the clock timed the
    collectives (``waits_timed``) backward and step less the time spent in them."""
    return sum(own_phase(p, k, waits_timed) for k in OWN)


def shared_queue(per_rank: list[dict], hosts: list[str], waits_timed: bool) -> list[dict]:
    """Each rank's own work per ``OWN`` phase, its run-queue wait (``QUEUED``: runnable, no core free)
    replaced by the mean of its host's ranks in that phase: which rank of a loaded host the scheduler
    makes wait is chance, how long the host's ranks wait is its load. Where nothing was queued (a GPU,
    a kernel without the count) this is ``own_phase`` of every phase."""
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    out = []
    for r, p in enumerate(per_rank):
        mates = by_host.get(hosts[r], [r])
        row = {}
        for phase in OWN:
            if phase not in LOCAL and not waits_timed:
                row[phase] = 0.0  # no evidence: collectives untimed (a GPU's backward and step)
                continue
            queued = [per_rank[m].get(QUEUED[phase], 0.0) for m in mates]
            row[phase] = own_phase(p, phase, waits_timed) - p.get(QUEUED[phase], 0.0) + sum(queued) / len(queued)
        out.append(row)
    return out


def median_of_others(values: list[float], i: int) -> float:
    others = values[:i] + values[i + 1:]
    return statistics.median(others) if others else values[i]


class StragglerDetector:
    def __init__(self, hosts: list[str], factor: float = 1.5, windows: int = 6, record: Optional[Path] = None,
                 span_s: float = 5.0, waits_timed: bool = False):
        """``windows``: the span (logging windows) over which the evidence is summed, lengthened
        until it holds at least ``span_s`` seconds of steps (short windows, e.g. a log line every
        step, are each mostly scheduling noise); nobody is named before a full span is seen.
        ``record``: a JSON file (rank 0's) rewritten whenever a rank is named: the named ranks, their
        hosts and the line, for ``vit-launch run --exclude-slow-hosts``. ``waits_timed``: the phase
        seconds carry ``WAITED`` (``StepClock.times_waits``), so backward and step count as evidence."""
        self.waits_timed = waits_timed
        self.hosts, self.factor, self.windows, self.record = list(hosts), factor, windows, record
        self.span_s = span_s
        self.span: deque[tuple[list[dict], float]] = deque()  # (phase seconds per rank, the window's seconds)
        self.seconds = 0.0  # of the windows in the span
        # phase seconds per rank over the span, kept as windows come and go
        self.summed = [dict.fromkeys(CLOCKED, 0.0) for _ in self.hosts]
        self.named: set[int] = set()

    def _full(self) -> bool:
        return len(self.span) >= self.windows and self.seconds >= self.span_s

    def _add(self, window: list[dict], sign: float) -> None:
        for total, p in zip(self.summed, window):
            for k in total:
                total[k] += sign * p.get(k, 0.0)

    def observe(self, per_rank: list[dict]) -> tuple[dict, Optional[str]]:
        """One window's phase seconds per rank -> (metrics for this window, a line naming a
        straggler or None)."""
        window = [dict(p) for p in per_rank]
        self.span.append((window, max(sum(p.get(k, 0.0) for k in PHASES) for p in window)))
        self.seconds += self.span[-1][1]
        self._add(window, 1.0)
        while len(self.span) > self.windows and (self.seconds - self.span[0][1] >= self.span_s
                                                 or len(self.span) > 100 * self.windows):
            old, sec = self.span.popleft()
            self.seconds -= sec
            self._add(old, -1.0)
        evidence = shared_queue(self.summed, self.hosts, self.waits_timed)
        local = [sum(e.values()) for e in evidence]
        ratios = [local[i] / max(median_of_others(local, i), 1e-9) for i in range(len(local))]
        slowest = max(range(len(ratios)), key=ratios.__getitem__)
        metrics = {"straggler/slowest_rank": slowest, "straggler/slowest_host": self.hosts[slowest],
                   "straggler/ratio": ratios[slowest]}
        if len(per_rank) <= 64:  # one series per rank in W&B; past that the summary says enough
            metrics.update({f"straggler/own_seconds/rank_{r}": sum(e.values())
                            for r, e in enumerate(shared_queue(window, self.hosts, self.waits_timed))})
        line = None
        recovered = 1.0 + (self.factor - 1.0) / 2
        for r, ratio in enumerate(ratios):
            if ratio < recovered:
                self.named.discard(r)
            elif (ratio >= self.factor and self._full() and r not in self.named
                  and line is None):
                self.named.add(r)
                line = (f"rank {r} on {self.hosts[r]}: {ratio:.1f}x the median step, mostly in "
                        f"{self.worst_phase(evidence, r)}")
        if line and self.record is not None:
            from data_pipeline.files import write_json

            write_json(self.record, {"ranks": sorted(self.named), "hosts": self.slow_hosts(), "line": line,
                                     "time": time.time()})
        return metrics, line

    @staticmethod
    def worst_phase(evidence: list[dict], r: int) -> str:
        """The phase where rank ``r`` spent the most of its own work (``shared_queue``'s) beyond the
        other ranks' median."""
        def excess(phase):
            vals = [e[phase] for e in evidence]
            return vals[r] - median_of_others(vals, r)
        return max(OWN, key=excess)

    def slow_hosts(self) -> list[str]:
        """Hosts of the ranks named so far and not recovered since."""
        return sorted({self.hosts[r] for r in self.named})


def gather_and_judge(detector: Optional[StragglerDetector], phases: dict, device) -> tuple[dict, Optional[str]]:
    """Every rank's phase seconds of the window to rank 0 (one small all-gather); its verdict."""
    if detector is None:
        return {}, None
    mine = torch.tensor([phases.get(p, 0.0) for p in CLOCKED], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    per_rank = [dict(zip(CLOCKED, t.tolist())) for t in every]
    return detector.observe(per_rank)
