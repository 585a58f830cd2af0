"""Which shards each (rank, dataloader worker) slot reads in an epoch, and how many batches it yields.

Everything here is a pure function of the manifest counts, the seed, the epoch and the layout
(world size x workers x batch size), so every rank computes the same answer without talking to
the others, before reading a single tar.

Pre-training (``train=True``):
  * epoch ``e`` reads the shards in a permutation seeded by (seed, e); slot ``s`` of ``S`` slots
    takes every ``S``-th shard of that permutation (slot = rank * workers + worker). No shard is
    read twice and none is left out.
  * every slot yields the same number of batches, ``floor(L / batch)`` where ``L`` is the sum of
    the ``floor(N / S)`` smallest shard counts: a lower bound on any slot's samples in any epoch,
    so the count is the same for every epoch too. Samples a slot holds beyond its quota are
    dropped for balance and counted (with uniform shards that is the ``N mod S`` extra shards; keep
    the shard count a multiple of ``S`` or much larger than it). The permutation changes which
    samples are dropped each epoch.
Evaluation (``train=False``): shards in manifest order, same striding, every sample once, the
last batch of a slot may be short; ranks may yield different batch counts (documented in loader).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from data_pipeline.errors import DataError
from data_pipeline.manifest import Shard, ShardSet

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


@dataclass(frozen=True)
class Plan:
    shardset: ShardSet
    world_size: int
    workers: int  # reader slots per rank (1 when the DataLoader runs in-process)
    batch_size: int
    seed: int
    train: bool

    @property
    def slots(self) -> int:
        return self.world_size * self.workers

    def epoch_order(self, epoch: int) -> list[Shard]:
        order = list(self.shardset.shards)
        if self.train:
            random.Random(mix_seed(TAG_SHARDS, self.seed, epoch)).shuffle(order)
        return order

    def slot_shards(self, epoch: int, slot: int) -> list[Shard]:
        return self.epoch_order(epoch)[slot::self.slots]

    def batches_per_slot(self) -> int:
        """Training: batches every slot yields in every epoch (see module docstring)."""
        counts = sorted(s.samples for s in self.shardset.shards)
        per_slot = len(counts) // self.slots
        return sum(counts[:per_slot]) // self.batch_size

    def eval_batches(self, epoch: int, slot: int) -> int:
        return math.ceil(sum(s.samples for s in self.slot_shards(epoch, slot)) / self.batch_size)

    def rank_batches(self, rank: int, epoch: int = 0) -> int:
        if self.train:
            return self.batches_per_slot() * self.workers
        return sum(self.eval_batches(epoch, rank * self.workers + w) for w in range(self.workers))

    def check(self) -> None:
        """A layout that cannot give every slot a full batch is a user error, said before training."""
        if not self.train:
            return
        n = len(self.shardset.shards)
        if n < self.slots:
            raise DataError(
                f"{n} shard(s) cannot feed {self.world_size} rank(s) x {self.workers} worker(s) = "
                f"{self.slots} reader slots (each needs its own shard): write smaller shards "
                f"(vit-shards --shard-size) or lower data.workers ({self.shardset.manifests[0]})")
        if self.batches_per_slot() == 0:
            raise DataError(
                f"each of the {self.slots} reader slots gets fewer than batch_size={self.batch_size} "
                f"samples from {self.shardset.manifests[0]}: use more data, a smaller batch or fewer workers")
