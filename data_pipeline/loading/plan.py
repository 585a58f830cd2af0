"""Which samples each (rank, dataloader worker) slot reads in an epoch, and how many batches it yields.

Everything here is a pure function of the manifest counts, the seed, the epoch and the layout
(world size x workers x batch size), so every rank computes the same answer without talking to
the others, before reading a single tar.

Pre-training (``train=True``):
  * epoch ``e`` permutes the shards with (seed, e) and lays their samples end to end: the epoch's
    *sequence*, positions ``0..N-1``. Slots take contiguous ranges of it, in slot order
    (slot = rank * workers + worker), so a slot reads a run of shards, the first and the last
    possibly in part (skipping a tar's first members reads headers and decodes nothing; the read
    stops once the range ends). Each shard range is one sequential read; no sample is in two slots.
  * every rank yields ``q = N // (world_size * batch)`` batches per epoch: the same on every rank
    (no DDP hang) and in every epoch. Rank batch ``b`` comes from worker ``b % workers`` (the
    DataLoader's round robin), so worker ``w`` yields ``len(range(w, q, workers))`` batches and its
    range holds exactly that many batches of samples. The last ``N - q * world_size * batch``
    positions (fewer than one global batch, ``world_size * batch``) are dropped for balance; the
    permutation changes which samples those are each epoch. We drop rather than carry them into
    the next epoch: an epoch then stays exactly the (seed, epoch) permutation, which is what the
    per-sample augmentation seeds, the resume state and elastic resume (``rest.py``) are built on.
  * planning is O(shards + slots): a permutation, a prefix sum and a bisection per slot.
  * repeated augmentation (``repeats`` K > 1, ``data.repeat_augment``; DeiT's ``RASampler``): the
    epoch keeps its length, N draws, as DeiT's does, and draws the first ``M = ceil(N / K)``
    positions of the sequence K times each. The layout above is laid over the *pool* ``0..N-1``
    instead of the sequence, where pool entry ``c * M + p`` is copy ``c`` of position ``p``
    (copy-major; the last copy of the last ``K * M - N`` positions falls outside the pool). A
    rank's range holds at most ``N / world_size`` entries, no more than ``M`` when
    ``K <= world_size``, so the copies of a position, ``M`` apart, land on distinct ranks (DeiT's
    property: it deals the repeated list round-robin over ranks); with fewer ranks one rank holds
    at most ``ceil(K / world_size)`` of them. When K divides the world size the copies sit at
    nearly the same offset of their ranks' ranges (exactly when nothing rounds), so, up to each
    slot's shuffle buffer, in about the same step, as DeiT puts them in one global batch. A slot
    still reads contiguous runs of shards, each copy seeds its own augmentation (``Piece.copy``
    enters the sample's seed), and the pool is what the resume state, the rest of an epoch after a
    layout change and the sample log count in, so all of them hold as for K = 1 (there the pool is
    the sequence). The chosen positions are whole shards' worth: the writer shuffles samples into
    shards, and the (seed, epoch) permutation picks other shards each epoch.
Evaluation (``train=False``): manifest order, slot ``s`` of ``S`` takes positions
``[s*N//S, (s+1)*N//S)``: every sample once; rank ``r``'s slots together hold ``[r*N//world_size,
(r+1)*N//world_size)``, whatever the worker count. A slot's last batch may be short and ranks may yield
different batch counts (documented in loader).

``python -m data_pipeline.loading.plan MANIFEST [MANIFEST...] --world-size W --workers K --batch B`` prints
one line for a layout (``plan_line``): batches per rank per epoch, samples used and dropped, and
how long planning took.
"""
from __future__ import annotations

import itertools
import math
import random
import sys
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Union

from data_pipeline.errors import DataError
from data_pipeline.shards.manifest import Shard, ShardSet

_MASK = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """Hash integers into a 63-bit seed (splitmix64 steps): cheap enough to call once per sample,
    and nearby inputs (sample 41 vs 42) give unrelated seeds."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK)) & _MASK
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return x >> 1


# Tags keep the RNG streams of different purposes apart even for equal numeric arguments.
TAG_SHARDS, TAG_SHUFFLE, TAG_SAMPLE, TAG_BATCH = 1, 2, 3, 4


def shuffle_seed(seed: int, epoch: int, slot: int, level: int = 0) -> int:
    """Seed of a slot's shuffle buffer. ``level`` > 0: the rest of an epoch read by a new layout
    after an elastic resume (``rest.py``); level 0 keeps the seeds of a plain epoch."""
    if level == 0:
        return mix_seed(TAG_SHUFFLE, seed, epoch, slot)
    return mix_seed(TAG_SHUFFLE, seed, epoch, slot, level)


@dataclass(frozen=True)
class Piece:
    """Samples ``lo <= index < hi`` of ``shard`` (indices are positions inside the tar), read as
    their ``copy``-th repeat of the epoch (0 unless ``data.repeat_augment`` > 1)."""
    shard: Shard
    lo: int
    hi: int
    copy: int = 0

    @property
    def samples(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Plan:
    shardset: ShardSet
    world_size: int
    workers: int  # reader slots per rank (1 when the DataLoader runs in-process)
    batch_size: int
    seed: int
    train: bool
    repeats: int = 1  # training: data.repeat_augment, each chosen sample this many times per epoch

    @property
    def slots(self) -> int:
        return self.world_size * self.workers

    @property
    def total(self) -> int:
        """Samples in the data: the epoch's sequence, and the pool a training epoch lays out."""
        return self._sequence(0)[1][-1]

    @property
    def chosen(self) -> int:
        """Sequence positions a training epoch draws (``M``): all, or the first ceil(N / repeats)."""
        return -(-self.total // self.repeats) if self.train else self.total

    def copies(self, intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """Pool intervals as ``(lo, hi, copy)`` intervals of sequence positions, in pool order."""
        if not self.train or self.repeats == 1:
            return [(lo, hi, 0) for lo, hi in intervals]
        m, out = self.chosen, []
        for lo, hi in intervals:
            while lo < hi:
                c = lo // m
                end = min(hi, (c + 1) * m)
                out.append((lo - c * m, end - c * m, c))
                lo = end
        return out

    # -------------------------------------------------------------------- the epoch's sequence
    def __getstate__(self):  # the per-epoch cache is rebuilt where needed, not shipped to workers
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def _sequence(self, epoch: int) -> tuple[list[Shard], list[int]]:
        """(shards in epoch order, start position of each, plus the total at the end); the last
        epoch asked is cached (each worker asks about one epoch at a time)."""
        memo = self.__dict__.get("_memo")
        if memo is not None and memo[0] == epoch:
            return memo[1], memo[2]
        order = list(self.shardset.shards)
        if self.train:
            random.Random(mix_seed(TAG_SHARDS, self.seed, epoch)).shuffle(order)
        starts = [0, *itertools.accumulate(s.samples for s in order)]
        object.__setattr__(self, "_memo", (epoch, order, starts))
        return order, starts

    def epoch_order(self, epoch: int) -> list[Shard]:
        return list(self._sequence(epoch)[0])

    def shard_starts(self, epoch: int) -> dict[int, int]:
        """Shard index -> the sequence position of the shard's first sample in ``epoch`` (evaluation:
        in manifest order); a sample's position is its shard's start plus its index in the shard."""
        order, starts = self._sequence(epoch)
        return {s.index: at for s, at in zip(order, starts)}

    def pieces(self, epoch: int, intervals: Iterable[tuple[int, int]]) -> list[Piece]:
        """Pool positions (sorted, disjoint ``[lo, hi)`` intervals; with one repeat the sequence's
        own) as shard pieces in read order; touching pieces of one shard and copy are merged."""
        order, starts = self._sequence(epoch)
        out: list[Piece] = []
        for lo, hi, copy in self.copies(intervals):
            i = bisect_right(starts, lo) - 1
            while lo < hi:
                a, b = lo - starts[i], min(hi, starts[i + 1]) - starts[i]
                if b > a:
                    if out and out[-1].shard is order[i] and out[-1].hi == a and out[-1].copy == copy:
                        out[-1] = Piece(order[i], out[-1].lo, b, copy)
                    else:
                        out.append(Piece(order[i], a, b, copy))
                lo = starts[i] + b
                i += 1
        return out

    # ------------------------------------------------------------ layout of a pool of samples
    def rank_batches_for(self, size: int) -> int:
        """Batches every rank yields from a pool of ``size`` samples."""
        return size // (self.world_size * self.batch_size)

    def role_batches(self, q: int, role: int) -> int:
        """Of a rank's ``q`` batches, those worker ``role`` yields (rank batch b -> worker b % K)."""
        return len(range(role, q, self.workers))

    def slot_range(self, size: int, slot: int) -> tuple[int, int]:
        """The slot's ``[lo, hi)`` of a pool of ``size`` samples laid out for this layout."""
        rank, role = divmod(slot, self.workers)
        q, K, B = self.rank_batches_for(size), self.workers, self.batch_size
        lo = B * (rank * q + role * (q // K) + min(role, q % K))
        return lo, lo + B * self.role_batches(q, role)

    # ---------------------------------------------------------------------- a whole epoch
    def epoch_batches(self) -> int:
        """Training: batches every rank yields in every epoch."""
        return self.rank_batches_for(self.total)

    def used(self) -> int:
        return self.epoch_batches() * self.world_size * self.batch_size if self.train else self.total

    def dropped(self) -> int:
        """Samples an epoch leaves out for balance (fewer than world_size x batch_size)."""
        return self.total - self.used()

    def slot_pieces(self, epoch: int, slot: int) -> list[Piece]:
        if self.train:
            return self.pieces(epoch, [self.slot_range(self.total, slot)])
        n, S = self.total, self.slots
        return self.pieces(epoch, [(slot * n // S, (slot + 1) * n // S)])

    def slot_shards(self, epoch: int, slot: int) -> list[Shard]:
        """The shards a slot reads from (some of them perhaps in part)."""
        return [p.shard for p in self.slot_pieces(epoch, slot)]

    def layout(self, epoch: int) -> list[list[Piece]]:
        """Every slot's pieces: what all workers of all ranks compute between them (timed by the CLI)."""
        return [self.slot_pieces(epoch, s) for s in range(self.slots)]

    def eval_batches(self, epoch: int, slot: int) -> int:
        lo, hi = (slot * self.total // self.slots, (slot + 1) * self.total // self.slots)
        return math.ceil((hi - lo) / self.batch_size)

    def rank_batches(self, rank: int, epoch: int = 0) -> int:
        if self.train:
            return self.epoch_batches()
        return sum(self.eval_batches(epoch, rank * self.workers + w) for w in range(self.workers))

    def check(self) -> None:
        """A layout that cannot give every slot a full batch is a user error, said before training."""
        if not self.train:
            return
        need = self.slots * self.batch_size
        if self.total < need:
            raise DataError(
                f"each of the {self.slots} reader slots ({self.world_size} rank(s) x {self.workers} "
                f"worker(s)) gets fewer than batch_size={self.batch_size} samples: {self.total} in "
                f"{self.shardset.manifests[0]}, {need} needed; use more data, a smaller batch or fewer workers")


# ---------------------------------------------------------------------------- seeing the plan
def summary_line(plan: Plan, seconds: float) -> str:
    n, used, dropped = plan.total, plan.used(), plan.dropped()
    return (f"{n:,} samples in {len(plan.shardset.shards):,} shards on {plan.world_size} rank(s) x "
            f"{plan.workers} worker(s), batch {plan.batch_size}: {plan.epoch_batches():,} batches per rank "
            f"per epoch; {used:,} samples used, {dropped:,} dropped ({100.0 * dropped / max(1, n):.3f}%) "
            f"per epoch; planned in {seconds:.3f} s")


def plan_line(shards: Union[ShardSet, str, list], *, world_size: int, workers: int, batch_size: int,
              seed: int = 0, allow_remote: bool = False) -> str:
    """The one-line summary of the training plan for this layout (what ``python -m
    data_pipeline.loading.plan`` prints). ``shards`` is a ShardSet or a ``data.train_shards`` value;
    ``workers`` is ``data.workers`` (0 counts as one reader per rank, as in the loader). Raises
    ``DataError`` for a bad manifest or a layout that cannot give every reader slot a batch."""
    if isinstance(shards, ShardSet):
        shardset = shards
    else:
        from data_pipeline.shards.manifest import resolve_shards

        shardset = resolve_shards(shards, allow_remote=allow_remote, key="manifest")
    for name, v, least in (("world size", world_size, 1), ("workers", workers, 0), ("batch", batch_size, 1)):
        if not isinstance(v, int) or v < least:
            raise DataError(f"{name} must be an integer >= {least}, got {v!r}")
    t0 = time.perf_counter()
    plan = Plan(shardset, world_size, max(1, workers), batch_size, seed, True)
    plan.check()
    plan.layout(0)
    return summary_line(plan, time.perf_counter() - t0)


def main(argv=None) -> None:
    from data_pipeline.errors import Parser, cli_errors, path_arg

    ap = Parser(prog="python -m data_pipeline.loading.plan",
                                 description="Print the training data plan of one layout in one line")
    ap.add_argument("manifests", nargs="+", type=path_arg,
                    help="manifest.json file(s) (or shard folders / brace patterns)")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True, help="data.workers (0: in-process)")
    ap.add_argument("--batch", type=int, required=True, help="micro batch size per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-remote", action="store_true", help="read pipe:/object-store manifests")
    args = ap.parse_args(argv)
    with cli_errors("data_pipeline.loading.plan"):
        print(plan_line(args.manifests, world_size=args.world_size, workers=args.workers,
                        batch_size=args.batch, seed=args.seed, allow_remote=args.allow_remote))


if __name__ == "__main__":
    main(sys.argv[1:])
