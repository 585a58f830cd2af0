"""Streaming loader over WebDataset shards: deterministic split over (rank, worker), equal batch
counts on every rank, exact resume, corrupt-sample accounting.

    loader = build_loader(cfg.data, rank=r, world_size=w, batch_size=64, seed=0, img_size=224)
    loader.num_classes, loader.batches_per_epoch
    for images, targets in loader: ...        # endless in training, epoch after epoch
    state = loader.state_dict()               # position after the last batch *yielded*
    loader.load_state_dict(state)             # before iterating: continue exactly there

Training stream (``train=True``). Epoch ``e`` permutes the shards with (seed, e) and gives slot
``rank * workers + worker`` every ``S``-th one (``plan.py``); each slot shuffles with a buffer seeded
by (seed, e, slot) and yields exactly ``batches_per_epoch / workers`` batches, so every rank yields
the same count (no DDP hang) and what cannot be balanced is dropped and counted. ``images`` are
float32 (B, 3, H, W) normalised with augment.mean/std; ``targets`` int64 (B,), or float32
(B, num_classes) for multi-label data or when Mixup/CutMix is on.

Exact resume: the state is (epoch, batches yielded in the epoch, per-worker shuffle-buffer
emissions). Augmentation randomness is seeded per sample from (seed, epoch, shard position in the
manifest, index in shard), so with the same world size and worker count the following batches are
bit-identical; fast-forwarding reads tar members but decodes nothing (``stream.py``).
Resuming on another world size later: sample seeds and the epoch's shard permutation do not depend
on the layout, so a future ``load_state_dict`` can replay the old layout's slots (cheap, no decode)
to learn which (shard, index) pairs were consumed this epoch and have the new slots skip them.
Today a layout change raises ``DataError``, or with ``strict=False`` starts at the next epoch.

Evaluation stream (``train=False``): resize + center crop, one pass in manifest order, every sample
exactly once over all ranks, no shuffle, no drop. Ranks may yield *different* batch counts and
short last batches (one per worker): reduce metrics with sums after the loop, not per step.

Counters (``loader.counters``) are summed over workers for the batches yielded so far; kinds are
listed in ``tally.py``. When an epoch's bad samples on this rank exceed ``data.max_corrupt_rate`` of
the samples the rank is due, iteration raises ``TooManyCorruptSamples`` naming the worst shards.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils.data import DataLoader

from data_pipeline.errors import DataError, TooManyCorruptSamples
from data_pipeline.manifest import resolve_shards
from data_pipeline.plan import Plan
from data_pipeline.stream import Settings, SlotStream, Start

__all__ = ["build_loader", "ShardLoader", "DataError", "TooManyCorruptSamples"]
STATE_VERSION = 1


def build_loader(data_cfg, *, rank: int = 0, world_size: int = 1, batch_size: int, seed: int = 0,
                 img_size: int | None = None, train: bool = True, epoch: int = 0) -> "ShardLoader":
    """Build the loader for ``data_cfg`` (a ``pretrain.config.DataConfig``). Reads only manifests;
    raises ``DataError`` for a missing/inconsistent manifest, no matching shards, remote URLs
    without ``data.allow_remote``, or a layout that cannot give every reader slot a batch."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    key = "data.train_shards" if train else "data.val_shards"
    spec = data_cfg.train_shards if train else data_cfg.val_shards
    shardset = resolve_shards(spec, allow_remote=data_cfg.allow_remote, key=key)
    plan = Plan(shardset, world_size, max(1, data_cfg.workers), batch_size, seed, train)
    plan.check()
    size = img_size or data_cfg.img_size or 224
    return ShardLoader(data_cfg, plan, rank, size, epoch)


def _identity(x):
    return x


def _ignore_sigterm(worker_id: int) -> None:
    """Preemption sends SIGTERM to every process of the job: workers must outlive it so the main
    process can finish its step and checkpoint; they exit when the main process does."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ShardLoader:
    def __init__(self, data_cfg, plan: Plan, rank: int, img_size: int, epoch: int = 0):
        self.cfg, self.plan, self.rank = data_cfg, plan, rank
        self.num_classes = plan.shardset.num_classes
        self.batches_per_epoch = plan.rank_batches(rank)
        self.settings = Settings(data_cfg.augment, img_size, data_cfg.shuffle_buffer if plan.train else 0,
                                 data_cfg.max_image_pixels, data_cfg.multi_label)
        # Samples this rank is due per epoch: the denominator of the corrupt rate.
        if plan.train:
            self._due = self.batches_per_epoch * plan.batch_size
        else:
            W = plan.workers
            self._due = sum(s.samples for w in range(W) for s in plan.slot_shards(0, rank * W + w))
        self._counts: Counter = Counter()
        self._reset_epoch(epoch)

    def _reset_epoch(self, epoch: int) -> None:
        self._epoch, self._batch = epoch, 0
        self._emitted = [0] * self.plan.workers
        self._epoch_bad: Counter = Counter()  # shard name -> bad samples, this epoch

    @property
    def counters(self) -> dict:
        return dict(self._counts)

    @property
    def epoch(self) -> int:
        return self._epoch

    # ------------------------------------------------------------------------------ iteration
    def __iter__(self):
        start = Start(self._epoch, self._batch, tuple(self._emitted))
        stream = SlotStream(self.plan, self.rank, self.settings, start, self.num_classes)
        workers = self.cfg.workers
        # Batches come back in the DataLoader's default strict order (worker 0, 1, 2, ...): the
        # resume rotation in stream.py relies on it.
        loader = DataLoader(
            stream, batch_size=None, collate_fn=_identity, num_workers=workers,
            worker_init_fn=_ignore_sigterm if workers > 0 else None,
            prefetch_factor=self.cfg.prefetch_factor if workers > 0 else None,
            pin_memory=torch.cuda.is_available(),
            # DataLoader draws its worker base seed from this generator; the default would take
            # one number from the training process's global RNG per iterator and break its resume.
            generator=torch.Generator().manual_seed(0))
        for images, targets, meta in loader:
            self._account(meta)
            if images is not None:
                self._counts["samples"] += images.shape[0]
                yield images, targets
        if not self.plan.train:
            self._reset_epoch(self._epoch)

    def _account(self, meta: dict) -> None:
        tally = meta["tally"]
        self._counts.update(tally["counts"])
        self._epoch_bad.update(tally["bad_by_shard"])
        if "error" in meta:
            raise TooManyCorruptSamples(meta["error"] + self._worst())
        bad = sum(self._epoch_bad.values())
        if bad > self.cfg.max_corrupt_rate * self._due:
            raise TooManyCorruptSamples(
                f"epoch {self._epoch}, rank {self.rank}: {bad} bad samples of the {self._due} due "
                f"({100.0 * bad / max(1, self._due):.2f}%) exceed data.max_corrupt_rate="
                f"{self.cfg.max_corrupt_rate}" + self._worst())
        if "emitted" not in meta:  # evaluation: no resume state
            return
        expected = self._batch % self.plan.workers
        if meta["role"] != expected or meta["epoch"] != self._epoch:
            raise RuntimeError(f"loader out of step: got batch of role {meta['role']} epoch {meta['epoch']}, "
                               f"expected role {expected} epoch {self._epoch}")
        self._emitted[meta["role"]] = meta["emitted"]
        self._batch += 1
        if self._batch == self.batches_per_epoch:
            self._reset_epoch(self._epoch + 1)

    def _worst(self) -> str:
        worst = self._epoch_bad.most_common(3)
        return ("; worst shards: " + ", ".join(f"{name} ({n} bad)" for name, n in worst)) if worst else ""

    # --------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        p = self.plan
        return {
            "version": STATE_VERSION, "epoch": self._epoch, "batch": self._batch,
            "emitted": list(self._emitted), "rank": self.rank, "world_size": p.world_size,
            "workers": p.workers, "batch_size": p.batch_size, "seed": p.seed,
            "data": p.shardset.fingerprint(), "counters": dict(self._counts),
            "epoch_bad_by_shard": dict(self._epoch_bad),
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue at ``state``'s position. The layout (world size, workers, batch size, seed, data)
        must match for an exact resume; otherwise ``DataError``, or with ``strict=False`` the
        stream starts at the beginning of the next epoch (the rest of the stored one is skipped)."""
        version = state.get("version") if isinstance(state, dict) else state
        if version != STATE_VERSION:
            raise DataError(f"data loader state: unsupported version {version!r} (expected {STATE_VERSION})")
        p = self.plan
        mine = {"world_size": p.world_size, "workers": p.workers, "batch_size": p.batch_size,
                "seed": p.seed, "data": p.shardset.fingerprint(), "rank": self.rank}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        self._counts = Counter(state.get("counters", {}))
        if diff:
            if strict:
                k, (old, new) = next(iter(diff.items()))
                raise DataError(f"data loader state was saved with {k}={old}, now {new}: exact resume "
                                f"needs the same layout and data (load_state_dict(state, strict=False) "
                                f"starts at the next epoch instead)")
            self._reset_epoch(int(state["epoch"]) + 1)
            return
        self._reset_epoch(int(state["epoch"]))
        self._batch = int(state["batch"])
        self._emitted = [int(x) for x in state["emitted"]]
        self._epoch_bad = Counter(state.get("epoch_bad_by_shard", {}))
