"""Repeated augmentation (``data.repeat_augment``) in the sample plan, against DeiT's ``RASampler``
(deit/samplers.py; DeiT is not installed, so a plain re-implementation of it is written here).

DeiT repeats each index of the epoch's permutation K times, deals the list round-robin over the
ranks and keeps ``len(dataset) // 256 * 256 / world`` indices per rank. The plan draws the same
global multiset on the same permutation (the epoch's sequence) wherever neither rounds, and keeps
what DeiT's dealing promises everywhere: the same count on every rank, a sample's copies on distinct
ranks (with at least K ranks; with fewer, no rank more than ceil(K / world) of them). Which rank
gets which copy differs by design: a rank of ours reads contiguous runs of shards, not every
world-th entry of the repeated list."""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import pytest

from data_pipeline.errors import ConfigError
from data_pipeline.loading.plan import Plan
from data_pipeline.shards.manifest import Shard, ShardSet
from pretrain.config import load_config


def _shardset(counts) -> ShardSet:
    shards = tuple(Shard(i, f"s{i}.tar", f"/nowhere/s{i}.tar", c) for i, c in enumerate(counts))
    return ShardSet(shards, ("a", "b"), False, ("/nowhere/manifest.json",))


def deit_ra_sampler(permutation: list, rank: int, world: int, repeats: int) -> list:
    """DeiT's ``RASampler.__iter__`` for one rank, its ``torch.randperm`` replaced by ``permutation``
    (3 repeats in DeiT's code)."""
    n = len(permutation)
    num_samples = int(math.ceil(n * repeats / world))
    total_size = num_samples * world
    num_selected = int(math.floor(n // 256 * 256 / world))
    indices = [i for i in permutation for _ in range(repeats)]
    indices += indices[:total_size - len(indices)]
    assert len(indices) == total_size
    indices = indices[rank:total_size:world]
    assert len(indices) == num_samples
    return indices[:num_selected]


def ours(plan: Plan, epoch: int) -> list[list]:
    """Each rank's samples of the epoch, as (shard, index in shard) pairs (copies repeat them)."""
    out = []
    for rank in range(plan.world_size):
        pieces = [p for role in range(plan.workers) for p in plan.slot_pieces(epoch, rank * plan.workers + role)]
        out.append([(p.shard.index, i) for p in pieces for i in range(p.lo, p.hi)])
    return out


def sequence(plan: Plan, epoch: int) -> list:
    """The epoch's permutation: its sequence of samples, as a plan without repeats reads it."""
    plain = Plan(plan.shardset, 1, 1, 1, plan.seed, True)
    return [(p.shard.index, i) for p in plain.pieces(epoch, [(0, plain.total)]) for i in range(p.lo, p.hi)]


def ranks_of_copies(per_rank: list[list]) -> dict:
    where = defaultdict(list)
    for rank, samples in enumerate(per_rank):
        for s in samples:
            where[s].append(rank)
    return where


def check_promises(per_rank: list[list], repeats: int) -> None:
    """What DeiT's sampler promises: every rank the same count; the copies of a sample on distinct
    ranks, or with fewer ranks than copies, spread as evenly as the ranks allow."""
    world = len(per_rank)
    assert len({len(r) for r in per_rank}) == 1
    for sample, ranks in ranks_of_copies(per_rank).items():
        assert len(ranks) <= repeats, sample
        most = max(Counter(ranks).values())
        assert most <= math.ceil(repeats / world), (sample, ranks)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_the_epoch_draws_deits_multiset_on_the_same_permutation(world):
    """768 samples (a multiple of 256, of K = 3 and of world x batch): nothing rounds, and the
    epoch's global multiset is DeiT's, each of the first 256 samples of the permutation 3 times."""
    plan = Plan(_shardset([24] * 32), world, 2, 8, 5, True, 3)
    for epoch in (0, 1):
        perm = sequence(plan, epoch)
        deit = [deit_ra_sampler(perm, r, world, 3) for r in range(world)]
        mine = ours(plan, epoch)
        assert Counter(s for r in mine for s in r) == Counter(s for r in deit for s in r) \
            == Counter({s: 3 for s in perm[:256]})
        assert [len(r) for r in mine] == [len(r) for r in deit] == [768 // world] * world
        check_promises(deit, 3)
        check_promises(mine, 3)


def test_a_sweep_of_layouts_keeps_deits_promises():
    """Shard sizes, ranks, workers, batches and repeat counts at random: every rank draws the same
    count (the epoch's length is the one without repeats), the copies of a sample lie on distinct
    ranks when there are as many ranks as copies, and the epoch draws the first ceil(N / K) samples
    of its permutation, all K times but those whose last copies fell past N or into the dropped tail
    (fewer than one global batch); DeiT's sampler, given the same permutation, keeps the same
    promises."""
    rng = random.Random(0)
    checked = 0
    for _ in range(150):
        counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 20))]
        world, workers, batch, repeats = rng.randint(1, 8), rng.randint(1, 3), rng.randint(1, 6), rng.randint(2, 4)
        plan = Plan(_shardset(counts), world, workers, batch, rng.randint(0, 9), True, repeats)
        n = plan.total
        if n < plan.slots * batch:
            continue
        checked += 1
        plain = Plan(plan.shardset, world, workers, batch, plan.seed, True)
        mine = ours(plan, 1)
        assert [len(r) for r in mine] == [plain.epoch_batches() * batch] * world
        check_promises(mine, repeats)
        drawn = Counter(s for r in mine for s in r)
        perm = sequence(plan, 1)
        chosen = -(-n // repeats)
        pool = [perm[p] for _ in range(repeats) for p in range(chosen)][:n]  # copy-major, cut at N
        assert drawn == Counter(pool[:plan.used()]) and set(drawn) == set(perm[:chosen])
        assert sum(1 for k in drawn.values() if k < repeats) < repeats + world * batch
        if n >= 256:
            check_promises([deit_ra_sampler(perm, r, world, repeats) for r in range(world)], repeats)
    assert checked > 100


def test_the_config_takes_a_count_of_at_least_one():
    assert load_config(None, ["data.repeat_augment=3"]).data.repeat_augment == 3
    with pytest.raises(ConfigError, match="data.repeat_augment: must be an integer >= 1"):
        load_config(None, ["data.repeat_augment=0"])
