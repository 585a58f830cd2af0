"""The rest of an interrupted epoch, read by another layout (elastic data resume).

A loader's state says, for each (rank, worker) slot, how many samples the slot's shuffle buffer had
emitted when the last yielded batch was made (``emitted``). Which samples those were is computable
without reading a tar: a slot's arrivals are exactly its planned positions, in order (the reader
puts a placeholder where a tar failed to deliver a sample, ``shard_reader.read_shard``), and the
buffer's choices depend only on its RNG and the arrival order. So replaying the buffer on arrival
*indices* (``remaining_arrivals``) says which positions the old layout consumed; that costs about
a microsecond per consumed sample of the slots one needs, and no I/O.

Counting is by arrival position, not by good samples: a corrupt sample or a placeholder the old
layout emitted counts as consumed (it is not offered again). Once a slot emitted more than its
range (a repeated pass, because bad samples ate its slack) the whole range counts as consumed.

The *pool* of an epoch is the ordered list of its sequence positions (``plan.py``) still to be
read: all of them for a fresh epoch; after a layout change, for each old slot in slot order the
positions its buffer had not emitted (those still in the buffer, then those not yet read), then the
old layout's dropped tail. The new layout lays its slots over the pool exactly as a fresh epoch
lays them over the sequence (``Plan.slot_range``): equal batches per rank, fewer than one global
batch dropped. A change in the middle of such a rest-epoch nests: the state then carries the
previous source (``source["rest"]``), and the pools are built recursively.

With ``data.repeat_augment`` the positions are those of the epoch's pool (``plan.py``: copy-major
repeats of the chosen positions), so the rest holds each copy the old layout had not consumed once;
the new layout lays them out afresh, so in the rest of that one epoch a sample's copies may share
a rank.

A new rank only replays the old slots whose leftovers fall into its own slots' ranges (slot sizes
in the pool are known without replay: ``range - emitted``).
"""
from __future__ import annotations

import random
from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional

from data_pipeline.loading.plan import Plan, shuffle_seed


def remaining_arrivals(n: int, emitted: int, buffer_size: int, seed: int) -> list[tuple[int, int]]:
    """Arrival indices (``0..n-1``) of a slot its shuffle buffer had not emitted after ``emitted``
    emissions, as sorted ``[lo, hi)`` intervals; replays ``stream.ShuffleBuffer`` itself."""
    from data_pipeline.loading.stream import ShuffleBuffer

    if emitted >= n:
        return []
    if emitted <= 0:
        return [(0, n)]
    read = [0]

    def arrivals():
        for i in range(n):
            read[0] = i + 1
            yield i

    buffer = ShuffleBuffer(buffer_size, random.Random(seed))
    out = buffer(arrivals())
    for _ in range(emitted):
        next(out)
    out.close()
    left = sorted(buffer.items)
    intervals = _intervals(left)
    if read[0] < n:
        intervals = _merge(intervals + [(read[0], n)])
    return intervals


def _intervals(sorted_points: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p in sorted_points:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in intervals:
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


class FullPool:
    """A fresh epoch: every sequence position, in order."""

    def __init__(self, size: int):
        self.size = size

    def intervals(self, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(lo, hi)] if hi > lo else []


class RestPool:
    """What ``prev`` still holds after the layout ``old`` (at ``level``) emitted ``emitted[slot]``."""

    def __init__(self, prev, old: Plan, emitted: list[int], buffer_size: int, epoch: int, level: int):
        if len(emitted) != old.slots:
            raise ValueError(f"{len(emitted)} emitted counts for {old.slots} slots")
        self.prev, self.old, self.buffer_size, self.epoch, self.level = prev, old, buffer_size, epoch, level
        self.segments: list[tuple[int, Optional[int], int, int, int]] = []  # (count, slot, base, n, emitted)
        for slot in range(old.slots):
            lo, hi = old.slot_range(prev.size, slot)
            n, c = hi - lo, min(max(0, int(emitted[slot])), hi - lo)
            if n > c:
                self.segments.append((n - c, slot, lo, n, c))
        used = old.rank_batches_for(prev.size) * old.world_size * old.batch_size
        if prev.size > used:  # the old layout's dropped tail is still owed to this epoch
            self.segments.append((prev.size - used, None, used, 0, 0))
        self.starts = [0]
        for seg in self.segments:
            self.starts.append(self.starts[-1] + seg[0])
        self.size = self.starts[-1]
        self._left: dict[int, list[tuple[int, int]]] = {}

    def _leftover(self, slot: int, n: int, c: int) -> list[tuple[int, int]]:
        if slot not in self._left:
            seed = shuffle_seed(self.old.seed, self.epoch, slot, self.level)
            self._left[slot] = remaining_arrivals(n, c, self.buffer_size, seed)
        return self._left[slot]

    def intervals(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Sequence positions of pool entries ``lo..hi-1``, as sorted intervals."""
        out: list[tuple[int, int]] = []
        i = bisect_right(self.starts, lo) - 1
        while lo < hi:
            count, slot, base, n, c = self.segments[i]
            a, b = lo - self.starts[i], min(hi, self.starts[i + 1]) - self.starts[i]
            if slot is None:
                out += self.prev.intervals(base + a, base + b)
            else:
                k = 0  # leftover entries before interval (x, y)
                for x, y in self._leftover(slot, n, c):
                    s0, s1 = max(a, k), min(b, k + y - x)
                    if s1 > s0:
                        out += self.prev.intervals(base + x + s0 - k, base + x + s1 - k)
                    k += y - x
                    if k >= b:
                        break
            lo = self.starts[i] + b
            i += 1
        return _merge(out)


@dataclass(frozen=True)
class RestEpoch:
    """The rest of ``epoch`` as one rank of the new layout reads it."""
    epoch: int
    level: int  # 1 for the first layout change in this epoch, 2 for a second one...
    batches: int  # per rank (the same on every rank)
    pieces: tuple  # per worker role of this rank: tuple of Piece
    dropped: int  # pool entries no slot reads (fewer than one global batch)
    source: dict  # what the state saves to rebuild this


def pool_for(plan: Plan, source: Optional[dict]):
    """(pool of ``source["epoch"]`` still to be read, level of the layout that reads it)."""
    if source is None:
        return FullPool(plan.total), 0
    prev, level = pool_for(plan, source.get("rest"))
    old = Plan(plan.shardset, int(source["world_size"]), int(source["workers"]), int(source["batch_size"]),
               plan.seed, True, plan.repeats)
    pool = RestPool(prev, old, [int(x) for x in source["emitted"]], int(source["shuffle_buffer"]),
                    int(source["epoch"]), level)
    return pool, level + 1


def rest_epoch(plan: Plan, rank: int, source: dict) -> RestEpoch:
    """What ``rank`` of ``plan``'s layout reads of the epoch ``source`` describes: a dict with the
    old layout (``world_size``, ``workers``, ``batch_size``, ``shuffle_buffer``), ``epoch``, the
    flat per-slot ``emitted`` list (slot = rank * workers + worker) and ``rest`` (the source of the
    old layout's own rest-epoch, or None)."""
    pool, level = pool_for(plan, source)
    q = plan.rank_batches_for(pool.size)
    pieces = []
    for role in range(plan.workers):
        lo, hi = plan.slot_range(pool.size, rank * plan.workers + role)
        pieces.append(tuple(plan.pieces(int(source["epoch"]), pool.intervals(lo, hi))))
    return RestEpoch(int(source["epoch"]), level, q, tuple(pieces),
                     pool.size - q * plan.world_size * plan.batch_size, source)
