"""Streaming loader over WebDataset shards: deterministic split over (rank, worker), equal batch
counts on every rank, exact resume, corrupt-sample accounting.

    loader = build_loader(cfg.data, rank=r, world_size=w, batch_size=64, seed=0, img_size=224,
                          device=engine.device)   # where batches are normalised (default: the CPU)
    loader.num_classes, loader.batches_per_epoch
    for images, targets in loader: ...        # endless in training, epoch after epoch
    loader.last_keys, loader.last_shards      # __key__ and shard name of each sample of that batch
    loader.last_epoch                         # the epoch that batch belongs to
    state = loader.state_dict()               # position after the last batch *yielded*
    loader.load_state_dict(state)             # before iterating: continue exactly there
    loader.load_state_dicts(states)           # all old ranks' states: any layout (elastic resume)

Training stream (``train=True``). Epoch ``e`` permutes the shards with (seed, e), lays their samples
end to end and gives slot ``rank * workers + worker`` a contiguous range of them (``plan.py``);
each slot shuffles with a buffer seeded by (seed, e, slot); every rank yields the same
``batches_per_epoch`` (no DDP hang), and the fewer than ``world_size x batch_size`` samples that
cannot be balanced are dropped and counted (by rank 0, as ``dropped_for_balance``). ``images`` are
float32 (B, 3, H, W) normalised with augment.mean/std, on ``device``; ``targets`` int64 (B,), or
float32 (B, num_classes) for multi-label data or when Mixup/CutMix is on.

The batch contract inside: a worker sends each batch as uint8 (``batch_decode.DeferredBatch``: one
(B, 3, H, W) shared-memory tensor, the targets, the batch's Mixup/CutMix seed), never float; this
process finishes it (``batch_decode.BatchDecoder``): (x - 255 mean) / (255 std) as
``x * (1 / (255 std)) + (-mean / std)`` in float32, then Mixup/CutMix, on ``device`` (on a GPU one
batch ahead on a side stream, from pinned memory), and then releases the worker's shared-memory
tensor for reuse (``batch_decode.BatchBuffers``). Workers send a quarter of the bytes a float
batch has; on a GPU the host does no per-pixel float work at all.

Exact resume: the state is (epoch, batches yielded in the epoch, per-worker shuffle-buffer
emissions). Augmentation randomness is seeded per sample from (seed, epoch, shard position in the
manifest, index in shard), so with the same world size and worker count the following batches are
bit-identical; fast-forwarding reads tar members but decodes nothing (``stream.py``).

Elastic resume (another world size, ``data.workers``, micro batch or shuffle buffer):
``load_state_dicts(states)`` with the states of *all* old ranks. The rest of the interrupted epoch
is then exactly the samples the old layout had not consumed, each once, laid over the new layout
with equal batches per rank (fewer than one global batch dropped); the next epoch follows the new
layout's plan (``rest.py``). Sample seeds and the epoch's permutation do not depend on the layout,
so a sample looks the same whichever layout reads it.

Evaluation stream (``train=False``): resize + center crop, one pass in manifest order, every sample
exactly once over all ranks, no shuffle, no drop. Ranks may yield *different* batch counts and
short last batches (one per worker): reduce metrics with sums after the loop, not per step.

Exclusion (``data.exclude_keys: FILE``, e.g. vit-audit's exclude.txt): samples whose ``__key__`` is
listed are dropped before decoding and counted as ``excluded``; like bad samples they leave the
slot short, so it refills its batches from a further pass (``repeated_for_balance``).

Decode device (``data.decode_device``, ``batch_decode.py``): ``worker`` decodes in the workers as
above; ``cuda`` / ``cpu`` / ``dali`` have the workers ship plain JPEGs undecoded with their crop
boxes, and this process decodes, crops and normalises each batch there (nvJPEG on a GPU, ignoring
``device``: the current CUDA device; DALI's pipeline, with ``data.workers`` threads, on the GPU or
the CPU; the ``cpu`` path gives bit-identical batches to ``worker`` when no draft decode applies,
and exists to test it).

Worker decode (``data.worker_decoder``, ``shards/crop_decode.py``): in training, a worker decodes only
the crop window of each plain JPEG when nvImageCodec is installed (``auto``), else the whole image
with PIL; the crop boxes and so the batches' samples and resume are the same either way, the
pixels are those of a full decode (PIL's draft mode differs slightly where it applies).
``loader.worker_decoder`` says which path, in words.

Counters (``loader.counters``) are summed over workers for the batches yielded so far; kinds are
listed in ``tally.py``. When an epoch's bad samples on this rank exceed ``data.max_corrupt_rate`` of
the samples the rank is due, iteration raises ``TooManyCorruptSamples`` naming the worst shards.
A remote store that stays away past ``data.remote_retry_s`` raises ``StoreUnreachable`` (exit 69:
an outage, not bad data), whichever worker met it.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils.data import DataLoader

from data_pipeline.errors import DataError, TooManyCorruptSamples
from data_pipeline.loading.batch_decode import BatchBuffers, BatchDecoder, check_device
from data_pipeline.loading.plan import Plan
from data_pipeline.loading.remainder import RestEpoch, rest_epoch
from data_pipeline.loading.stream import Settings, SlotStream, Start
from data_pipeline.loading.transforms import SampleTransform
from data_pipeline.loading.workers import worker_init
from data_pipeline.shards import crop_decode
from data_pipeline.shards.exclude import read_exclusion
from data_pipeline.shards.manifest import resolve_shards
from data_pipeline.storage.retry import RemotePolicy, StoreUnreachable

__all__ = ["build_loader", "ShardLoader", "DataError", "TooManyCorruptSamples"]
# 2: sample-range plan; adds shuffle_buffer and rest (the elastic source of a rest-epoch).
STATE_VERSION = 2


def build_loader(data_cfg, *, rank: int = 0, world_size: int = 1, batch_size: int, seed: int = 0,
                 img_size: int | None = None, train: bool = True, epoch: int = 0,
                 device=None) -> "ShardLoader":
    """Build the loader for ``data_cfg`` (a ``data_pipeline.config.DataConfig``). Reads only manifests;
    raises ``DataError`` for a missing/inconsistent manifest, no matching shards, remote URLs
    without ``data.allow_remote``, or a layout that cannot give every reader slot a batch.
    ``device`` (a ``torch.device`` or its name; None: the CPU): where ``data.decode_device: worker``
    batches are normalised and mixed and so where they arrive, the training device."""
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
    return ShardLoader(data_cfg, plan, rank, size, epoch, torch.device(device or "cpu"))


def _identity(x):
    return x


class ShardLoader:
    def __init__(self, data_cfg, plan: Plan, rank: int, img_size: int, epoch: int = 0,
                 device: torch.device = torch.device("cpu")):
        self.cfg, self.plan, self.rank = data_cfg, plan, rank
        self.num_classes = plan.shardset.num_classes
        self.batches_per_epoch = plan.rank_batches(rank)
        exclude = read_exclusion(data_cfg.exclude_keys, "data.exclude_keys").keys \
            if getattr(data_cfg, "exclude_keys", None) else frozenset()
        decode_device = getattr(data_cfg, "decode_device", "worker")
        worker_decoder = crop_decode.resolve(getattr(data_cfg, "worker_decoder", "auto")) if plan.train else "pil"
        self.worker_decoder = crop_decode.describe(worker_decoder)  # for the start-up log, in words
        self.settings = Settings(data_cfg.augment, img_size, data_cfg.shuffle_buffer if plan.train else 0,
                                 data_cfg.max_image_pixels, data_cfg.multi_label, exclude, decode_device,
                                 worker_decoder, RemotePolicy.of(data_cfg))
        if decode_device != "worker":
            check_device(decode_device)
        # every batch is finished here: normalised and mixed (and with cpu/cuda/dali, decoded first)
        self._decoder = BatchDecoder(SampleTransform(data_cfg.augment, img_size, plan.train), data_cfg.augment,
                                     device if decode_device == "worker" else decode_device,
                                     data_cfg.max_image_pixels, self.num_classes, threads=max(1, data_cfg.workers))
        # Samples this rank is due per epoch: the denominator of the corrupt rate.
        if plan.train:
            self._due = self.batches_per_epoch * plan.batch_size
        else:
            W = plan.workers
            self._due = sum(p.samples for w in range(W) for p in plan.slot_pieces(0, rank * W + w))
        self._counts: Counter = Counter()
        self.last_keys: list[str] = []  # of the last yielded batch: each sample's __key__
        self.last_shards: list[str] = []  # ... and its shard's name
        self.last_epoch: int = epoch  # ... and the epoch it belongs to
        self._reset_epoch(epoch)

    def _reset_epoch(self, epoch: int, rest: RestEpoch | None = None) -> None:
        self._epoch, self._batch, self._rest = epoch, 0, rest
        self._emitted = [0] * self.plan.workers
        self._epoch_bad: Counter = Counter()  # shard name -> bad samples, this epoch

    @property
    def batches_this_epoch(self) -> int:
        """Batches of the current epoch: ``batches_per_epoch``, or fewer for the rest of an epoch
        after an elastic resume."""
        return self._rest.batches if self._rest is not None else self.batches_per_epoch

    def _end_epoch(self) -> None:
        if self.rank == 0:  # the plan's dropped tail belongs to no rank: rank 0 counts it
            dropped = self._rest.dropped if self._rest is not None else self.plan.dropped()
            if dropped:
                self._counts["dropped_for_balance"] += dropped
        self._reset_epoch(self._epoch + 1)

    @property
    def counters(self) -> dict:
        return dict(self._counts)

    @property
    def epoch(self) -> int:
        return self._epoch

    # ------------------------------------------------------------------------------ iteration
    def __iter__(self):
        start = Start(self._epoch, self._batch, tuple(self._emitted), self._rest)
        workers = self.cfg.workers
        # a worker has at most prefetch_factor batches out, plus the one being finished and, on a
        # GPU, the one issued ahead: with that many buffers it reuses one on every batch
        buffers = BatchBuffers(workers, self.cfg.prefetch_factor + 2) if workers > 0 else None
        stream = SlotStream(self.plan, self.rank, self.settings, start, self.num_classes, buffers)
        # Batches come back in the DataLoader's default strict order (worker 0, 1, 2, ...): the
        # resume rotation in stream.py relies on it.
        loader = DataLoader(
            stream, batch_size=None, collate_fn=_identity, num_workers=workers,
            worker_init_fn=worker_init if workers > 0 else None,
            prefetch_factor=self.cfg.prefetch_factor if workers > 0 else None,
            pin_memory=self._decoder.device.type == "cuda",  # uploaded by the finisher
            # DataLoader draws its worker base seed from this generator; the default would take
            # one number from the training process's global RNG per iterator and break its resume.
            generator=torch.Generator().manual_seed(0))
        # batches finished here (on a GPU: one ahead, on a side stream)
        for images, targets, meta in self._decoder.finish(loader, buffers):
            epoch = self._epoch
            self._account(meta)
            if images is not None:
                self._counts["samples"] += images.shape[0]
                self.last_keys, self.last_shards, self.last_epoch = meta["keys"], meta["shards"], epoch
                yield images, targets
        if not self.plan.train:
            self._reset_epoch(self._epoch)

    def _account(self, meta: dict) -> None:
        tally = meta["tally"]
        self._counts.update(tally["counts"])
        self._epoch_bad.update(tally["bad_by_shard"])
        if meta.get("unreachable"):  # the store stayed away past data.remote_retry_s: not the data's fault
            raise StoreUnreachable(meta["error"])
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
        if self._batch == self.batches_this_epoch:
            self._end_epoch()

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
            "shuffle_buffer": self.settings.shuffle_buffer, "data": p.shardset.fingerprint(),
            "rest": self._rest.source if self._rest is not None else None,
            "counters": dict(self._counts), "epoch_bad_by_shard": dict(self._epoch_bad),
        }

    def _layout(self) -> dict:
        p = self.plan
        return {"world_size": p.world_size, "workers": p.workers, "batch_size": p.batch_size,
                "shuffle_buffer": self.settings.shuffle_buffer}

    def _check_same_data(self, state) -> None:
        version = state.get("version") if isinstance(state, dict) else state
        if version == 1:
            raise DataError("data loader state was saved by the shard-level plan (version 1), which this "
                            "loader no longer follows: load_state_dict(state, strict=False) starts at its next epoch")
        if version != STATE_VERSION:
            raise DataError(f"data loader state: unsupported version {version!r} (expected {STATE_VERSION})")
        for k, v in (("seed", self.plan.seed), ("data", self.plan.shardset.fingerprint())):
            if state.get(k) != v:
                raise DataError(f"data loader state was saved with {k}={state.get(k)}, now {v}: a data "
                                f"position only applies to the same data and seed")

    def load_state_dict(self, state, strict: bool = True) -> None:
        """Continue at ``state``'s position (before iterating). The same layout (world size,
        workers, batch size, shuffle buffer) continues bit-exactly. A list of every old rank's
        state goes to ``load_state_dicts`` (any layout). A single state of another layout raises
        ``DataError``, or with ``strict=False`` starts at the beginning of its next epoch."""
        if isinstance(state, (list, tuple)):
            return self.load_state_dicts(state)
        if not strict and isinstance(state, dict) and state.get("version") == 1:
            state = {**state, "version": STATE_VERSION, "shuffle_buffer": None}  # layout differs: next epoch
        else:
            self._check_same_data(state)
        mine = {**self._layout(), "rank": self.rank}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        self._counts = Counter(state.get("counters", {}))
        if diff:
            if strict:
                k, (old, new) = next(iter(diff.items()))
                raise DataError(f"data loader state was saved with {k}={old}, now {new}: resuming on another "
                                f"layout needs every old rank's state (load_state_dicts), or "
                                f"load_state_dict(state, strict=False) starts at the next epoch")
            self._reset_epoch(int(state["epoch"]) + 1)
            return
        rest = rest_epoch(self.plan, self.rank, state["rest"]) if state.get("rest") else None
        self._reset_epoch(int(state["epoch"]), rest)
        self._batch = int(state["batch"])
        self._emitted = [int(x) for x in state["emitted"]]
        self._epoch_bad = Counter(state.get("epoch_bad_by_shard", {}))

    def load_state_dicts(self, states: list) -> None:
        """Elastic resume: continue from the states of *all* ranks of the old run (one dict per old
        rank, as ``state_dict`` made them; any order), whatever its world size, workers, micro batch
        or shuffle buffer. The rest of the interrupted epoch is the samples the old layout had not
        consumed, each once, with equal batches on every rank of this layout (fewer than one global
        batch of them dropped, counted by rank 0); then epochs follow this layout's plan. Same
        layout: exactly ``load_state_dict(states[rank])``. Cost: replaying the shuffle buffers of
        the old slots that feed this rank, about a microsecond per consumed sample, no I/O.
        Counters: rank 0 takes the old ranks' sum, so the sum over ranks carries on."""
        states = sorted(states, key=lambda st: st.get("rank", -1) if isinstance(st, dict) else -1)
        if not states:
            raise DataError("load_state_dicts: no states given")
        for st in states:
            self._check_same_data(st)
        first = states[0]
        world = first.get("world_size")
        if [st.get("rank") for st in states] != list(range(len(states))) or world != len(states):
            last = world - 1 if isinstance(world, int) else "?"
            raise DataError(f"data loader states: need one state per old rank 0..{last}"
                            f", got ranks {[st.get('rank') for st in states]}")
        shared = ("epoch", "batch", "world_size", "workers", "batch_size", "shuffle_buffer", "rest")
        for st in states[1:]:
            k = next((k for k in shared if st.get(k) != first.get(k)), None)
            if k is not None:
                raise DataError(f"data loader states disagree on {k}: rank 0 has {first.get(k)!r}, "
                                f"rank {st['rank']} has {st.get(k)!r} (states of one checkpoint step needed)")
        if {k: first.get(k) for k in self._layout()} == self._layout():
            return self.load_state_dict(states[self.rank])
        total = Counter()
        for st in states:
            total.update(st.get("counters", {}))
        self._counts = total if self.rank == 0 else Counter()
        epoch = int(first["epoch"])
        emitted = [int(x) for st in states for x in st["emitted"]]
        if not any(emitted) and first.get("rest") is None:  # an epoch boundary: nothing to carry over
            self._reset_epoch(epoch)
            return
        source = {"epoch": epoch, "world_size": int(world), "workers": int(first["workers"]),
                  "batch_size": int(first["batch_size"]), "shuffle_buffer": int(first["shuffle_buffer"]),
                  "emitted": emitted, "rest": first.get("rest")}
        self._reset_epoch(epoch, rest_epoch(self.plan, self.rank, source))
        if self.batches_this_epoch == 0:  # fewer left than one global batch of this layout
            self._end_epoch()
