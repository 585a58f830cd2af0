"""Streaming loader over WebDataset shards: deterministic split over (rank, worker), equal batch
counts on every rank, exact resume, corrupt-sample accounting.

    loader = build_loader(cfg.data, rank=r, world_size=w, batch_size=64, seed=0, img_size=224,
                          device=engine.device)   # where batches are normalised (default: the CPU)
    loader.num_classes, loader.batches_per_epoch
    for images, targets in loader: ...        # endless in training, epoch after epoch
    loader.last_keys, loader.last_shards      # __key__ and shard name of each sample of that batch
    loader.last_positions                     # evaluation: each sample's position in manifest order
    loader.last_epoch                         # the epoch that batch belongs to
    loader.epochs_done                        # the position after it in epochs (2.25: a quarter into epoch 2)
    state = loader.state()                    # position after the last batch *yielded* (a LoaderState)
    loader.resume(states)                     # before iterating: every old rank's state, any layout
                                              # (elastic resume); on the same layout this rank's alone

Training stream (``train=True``). Epoch ``e`` permutes the shards with (seed, e), lays their samples
end to end and gives slot ``rank * workers + worker`` a contiguous range of them (``plan.py``);
each slot shuffles with a buffer seeded by (seed, e, slot); every rank yields the same
``batches_per_epoch`` (no DDP hang), and the fewer than ``world_size x batch_size`` samples that
cannot be balanced are dropped and counted (by rank 0, as ``dropped_for_balance``). ``images`` are
float32 (B, 3, H, W) normalised with augment.mean/std, on ``device``; ``targets`` int64 (B,), or
float32 (B, num_classes) for multi-label data or when Mixup/CutMix is on. With
``data.repeat_augment`` K an epoch keeps its batches but reads the first ceil(N / K) samples of its
sequence K times, each copy augmented afresh and, with at least K ranks, on another rank
(``plan.py``); everything counted below (positions, resume, the sample log) counts copies.

The batch contract inside: a worker sends each batch as uint8 (``batch.wire.DeferredBatch``:
one (B, 3, H, W) shared-memory tensor, the batch's Mixup/CutMix seed) with its targets and its
``batch.record.BatchRecord`` (position, counters, keys), never float; this process finishes it
(``batch.decode.BatchDecoder``): (x - 255 mean) / (255 std) as ``x * (1 / (255 std)) + (-mean /
std)`` in float32, then Mixup/CutMix, on ``device`` (on a GPU one batch ahead on a side stream, from
pinned memory: ``batch/prefetch.py``), and then releases the worker's shared-memory tensor for reuse
(``batch.buffers.BatchBuffers``). Workers send a quarter of the bytes a float batch has; on a GPU
the host does no per-pixel float work at all.

Exact resume: the state (``loader_state.LoaderState``) is (epoch, batches yielded in the epoch,
per-worker shuffle-buffer emissions), with the layout, seed and data it applies to. Augmentation
randomness is seeded per sample from (seed, epoch, shard position in the manifest, index in shard),
so with the same world size and worker count the following batches are bit-identical;
fast-forwarding reads tar members but decodes nothing (``stream.py``).

Elastic resume (another world size, ``data.workers``, micro batch or shuffle buffer):
``resume(states)`` with the states of *all* old ranks. The rest of the interrupted epoch is then
exactly the samples the old layout had not consumed, each once, laid over the new layout with equal
batches per rank (fewer than one global batch dropped); the next epoch follows the new layout's plan
(``remainder.py``). Sample seeds and the epoch's permutation do not depend on the layout,
so a sample looks the same whichever layout reads it.

Evaluation stream (``train=False``): resize + center crop, one pass, every sample exactly once over
all ranks, no shuffle, no drop. Rank ``r`` of ``W`` reads the manifest-order run ``[r*N//W,
(r+1)*N//W)`` of the ``N`` samples; with one reader (``data.workers`` 0 or 1) its batches come in
manifest order, with more each worker reads a contiguous part of the run and the DataLoader
interleaves their batches (each worker one sequential read, no byte read twice). A consumer that
needs rows in manifest order puts them back by ``loader.last_positions``. Ranks may yield
*different* batch counts and short last batches (one per worker): reduce metrics with sums after
the loop, not per step.

Resolution (``train.resolution_schedule``): ``loader.set_img_size(px)`` crops at ``px`` from the next
iterator on; that iterator starts where the last yielded batch left off, by the exact-resume path,
so the samples and their augmentation draws are those of the old size (``step_batches.py`` restarts
the iteration where a step's size changes). The plan, the state and the sample log do not depend on
the size.

Exclusion (``data.exclude_keys: FILE``, e.g. vit-audit's exclude.txt): samples whose ``__key__`` is
listed are dropped before decoding and counted as ``excluded``; like bad samples they leave the
slot short, so it refills its batches from a further pass (``repeated_for_balance``).

Decode device (``data.decode_device``, ``batch/decode.py``): ``worker`` decodes in the workers as
above; ``cuda`` / ``cpu`` / ``dali`` have the workers ship plain JPEGs undecoded with their crop
boxes, and this process decodes, crops and normalises each batch there (nvJPEG on a GPU, ignoring
``device``: the current CUDA device; DALI's pipeline, with ``data.workers`` threads, on the GPU or
the CPU; the ``cpu`` path gives bit-identical batches to ``worker`` when no draft decode applies,
and exists to test it).

Worker decode (``data.worker_decoder``, ``shards/crop_decode.py``): in training, a worker decodes only
the crop window of each plain JPEG when nvImageCodec is installed (``auto``), else the whole image
with PIL; the crop boxes and so the batches' samples and resume are the same either way, the
pixels are those of a full decode (PIL's draft mode differs slightly where it applies).
``loader.worker_decoder`` says which path, in words; ``loader.decode_path`` says who decodes the
JPEGs on the ``data.decode_device`` chosen, and with what (the training start-up line).

Counters (``loader.counters``) are summed over workers for the batches yielded so far; kinds are
listed in ``tally.py``. When an epoch's bad samples on this rank exceed ``data.max_corrupt_rate`` of
the samples the rank is due, iteration raises ``TooManyCorruptSamples`` naming the worst shards;
after an elastic resume each new rank carries its share of the bad samples the epoch had so far.
A remote store that stays away past ``data.remote_retry_s`` raises ``StoreUnreachable`` (exit 69:
an outage, not bad data), whichever worker met it.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

import torch
from torch.utils.data import DataLoader

from data_pipeline.errors import DataError, TooManyCorruptSamples
from data_pipeline.loading.batch.buffers import BatchBuffers
from data_pipeline.loading.batch.decode import BatchDecoder, check_device
from data_pipeline.loading.batch.prefetch import finish
from data_pipeline.loading.batch.record import BatchRecord
from data_pipeline.loading.loader_state import AGREED, LoaderState
from data_pipeline.loading.plan import Plan
from data_pipeline.loading.remainder import RestEpoch, rest_epoch
from data_pipeline.loading.stream import Settings, SlotStream, Start
from data_pipeline.loading.transforms import SampleTransform
from data_pipeline.loading.workers import share_temp_dir, worker_init
from data_pipeline.shards import crop_decode
from data_pipeline.shards.exclude import read_exclusion
from data_pipeline.shards.manifest import resolve_shards
from data_pipeline.storage.retry import RemotePolicy, StoreUnreachable

__all__ = ["build_loader", "ShardLoader", "DataError", "TooManyCorruptSamples"]


def plan_loader(data_cfg, *, world_size: int = 1, batch_size: int, seed: int = 0, train: bool = True) -> Plan:
    """The sample plan of ``data_cfg``'s training (``train``) or validation shards on this layout.
    Reads only manifests; raises ``DataError`` for a missing/inconsistent manifest, no matching
    shards, remote URLs without ``data.allow_remote``, or a layout that cannot give every reader
    slot a batch: what a run can check before it builds anything."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    key = "data.train_shards" if train else "data.val_shards"
    spec = data_cfg.train_shards if train else data_cfg.val_shards
    shardset = resolve_shards(spec, allow_remote=data_cfg.allow_remote, key=key, policy=RemotePolicy.of(data_cfg))
    plan = Plan(shardset, world_size, max(1, data_cfg.workers), batch_size, seed, train,
                data_cfg.repeat_augment if train else 1)
    plan.check()
    return plan


def build_loader(data_cfg, *, rank: int = 0, world_size: int = 1, batch_size: int, seed: int = 0,
                 img_size: int | None = None, train: bool = True, epoch: int = 0,
                 device=None, plan: Plan | None = None) -> "ShardLoader":
    """Build the loader for ``data_cfg`` (a ``data_pipeline.config.DataConfig``) on ``plan``
    (None: :func:`plan_loader`'s for these arguments, with its errors). ``device`` (a
    ``torch.device`` or its name; None: the CPU): where ``data.decode_device: worker`` batches are
    normalised and mixed and so where they arrive, the training device."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if plan is None:
        plan = plan_loader(data_cfg, world_size=world_size, batch_size=batch_size, seed=seed, train=train)
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
            if data_cfg.exclude_keys else frozenset()
        decode_device = data_cfg.decode_device
        worker_decoder = crop_decode.resolve(data_cfg.worker_decoder) if plan.train else "pil"
        self.worker_decoder = crop_decode.describe(worker_decoder)  # for the start-up log, in words
        self.settings = Settings(data_cfg.augment, img_size, data_cfg.shuffle_buffer if plan.train else 0,
                                 data_cfg.max_image_pixels, data_cfg.multi_label, exclude, decode_device,
                                 worker_decoder, RemotePolicy.of(data_cfg))
        if decode_device != "worker":
            check_device(decode_device)
        self._device = device if decode_device == "worker" else decode_device
        self._decoder = self._make_decoder(img_size)
        readers = f"{data_cfg.workers} data worker(s)" if data_cfg.workers else "this process (data.workers=0)"
        if decode_device == "worker":
            self.decode_path = f"data.decode_device=worker: JPEGs decoded by {readers}: {self.worker_decoder}"
        else:  # the workers still decode what is not a plain JPEG (PNG, progressive, CMYK, ...)
            self.decode_path = (f"data.decode_device={decode_device}: JPEGs decoded in this process by "
                                f"{self._decoder.describe()}; other images (PNG, progressive JPEG, ...) by "
                                f"{readers} with PIL")
        # Samples this rank is due per epoch: the denominator of the corrupt rate. In the rest of an
        # epoch after an elastic resume too: the rank then carries its share of the bad samples the
        # old layout met in that epoch (resume), so numerator and denominator span the whole epoch.
        if plan.train:
            self._due = self.batches_per_epoch * plan.batch_size
        else:
            W = plan.workers
            self._due = sum(p.samples for w in range(W) for p in plan.slot_pieces(0, rank * W + w))
        self._counts: Counter = Counter()
        self._count_manifest_retries()
        self.last_keys: list[str] = []  # of the last yielded batch: each sample's __key__
        self.last_shards: list[str] = []  # ... and its shard's name
        self.last_positions: list[int] = []  # ... and, in evaluation, its position in manifest order
        self.last_epoch: int = epoch  # ... and the epoch it belongs to
        self._reset_epoch(epoch)

    def _make_decoder(self, img_size: int) -> BatchDecoder:
        """Where every batch is finished: normalised and mixed (and with cpu/cuda/dali, decoded first)."""
        cfg = self.cfg
        return BatchDecoder(SampleTransform(cfg.augment, img_size, self.plan.train), cfg.augment, self._device,
                            cfg.max_image_pixels, self.num_classes, threads=max(1, cfg.workers))

    @property
    def img_size(self) -> int:
        return self.settings.img_size

    def set_img_size(self, img_size: int) -> None:
        """Crop at ``img_size`` px from the next iterator on (``train.resolution_schedule``). The
        position, the samples and each sample's augmentation draws stay; only the output size
        changes. An iterator already started keeps its size; the next one starts where the last
        yielded batch left off, by the exact-resume path (workers restart and read the tar members
        up to there without decoding them: about what a resume costs, once per switch)."""
        if img_size != self.settings.img_size:
            self.settings = dataclasses.replace(self.settings, img_size=int(img_size))
            self._decoder = self._make_decoder(int(img_size))

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

    @property
    def epochs_done(self) -> float:
        """Training: the position after the last batch yielded, in epochs: ``epoch`` plus the
        share of the epoch's positions (``plan.total``: the training set's samples; with
        ``data.repeat_augment`` copies count, as an epoch does) that every rank has consumed.
        Whole at an epoch boundary (``epoch`` moves on with the epoch's last batch); the same on
        every rank; after an elastic resume the positions the old layout consumed count, as the
        rest-epoch's pool is what they left. The balance drop is skipped, not consumed: the
        position jumps over it to the next whole epoch."""
        p = self.plan
        dropped = self._rest.dropped if self._rest is not None else p.dropped()
        left = (self.batches_this_epoch - self._batch) * p.world_size * p.batch_size
        return self._epoch + (p.total - dropped - left) / p.total

    # ------------------------------------------------------------------------------ iteration
    def __iter__(self):
        start = Start(self._epoch, self._batch, tuple(self._emitted), self._rest)
        workers = self.cfg.workers
        # a worker has at most prefetch_factor batches out, plus the one being finished and, on a
        # GPU, the one issued ahead: with that many buffers it reuses one on every batch
        buffers = BatchBuffers(workers, self.cfg.prefetch_factor + 2) if workers > 0 else None
        if workers > 0:
            share_temp_dir()
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
        for images, targets, record in finish(self._decoder, loader, buffers):
            epoch = self._epoch
            self._account(record)
            if images is not None:
                self._counts["samples"] += images.shape[0]
                self.last_keys, self.last_shards, self.last_epoch = record.keys, record.shards, epoch
                self.last_positions = record.positions
                yield images, targets
        if not self.plan.train:
            self._reset_epoch(self._epoch)

    def _account(self, record: BatchRecord) -> None:
        self._counts.update(record.tally["counts"])
        self._epoch_bad.update(record.tally["bad_by_shard"])
        if record.unreachable:  # the store stayed away past data.remote_retry_s: not the data's fault
            raise StoreUnreachable(record.error)
        if record.error is not None:
            raise TooManyCorruptSamples(record.error + self._worst())
        bad = sum(self._epoch_bad.values())
        if bad > self.cfg.max_corrupt_rate * self._due:
            raise TooManyCorruptSamples(
                f"epoch {self._epoch}, rank {self.rank}: {bad} bad samples of the {self._due} due "
                f"({100.0 * bad / max(1, self._due):.2f}%) exceed data.max_corrupt_rate="
                f"{self.cfg.max_corrupt_rate}" + self._worst())
        if not record.train:  # evaluation: no resume state
            return
        expected = self._batch % self.plan.workers
        if record.role != expected or record.epoch != self._epoch:
            raise RuntimeError(f"loader out of step: got batch of role {record.role} epoch {record.epoch}, "
                               f"expected role {expected} epoch {self._epoch}")
        self._emitted[record.role] = record.emitted
        self._batch += 1
        if self._batch == self.batches_this_epoch:
            self._end_epoch()

    def _worst(self) -> str:
        worst = self._epoch_bad.most_common(3)
        return ("; worst shards: " + ", ".join(f"{name} ({n} bad)" for name, n in worst)) if worst else ""

    # --------------------------------------------------------------------------------- resume
    def state(self) -> LoaderState:
        """This rank's position after the last batch it yielded (its checkpoint entry)."""
        p = self.plan
        return LoaderState(self._epoch, self._batch, tuple(self._emitted), self.rank, p.world_size, p.workers,
                           p.batch_size, p.seed, self.settings.shuffle_buffer, p.shardset.fingerprint(),
                           self._rest.source if self._rest is not None else None, dict(self._counts),
                           dict(self._epoch_bad), p.repeats)

    def _layout(self) -> tuple:
        p = self.plan
        return p.world_size, p.workers, p.batch_size, self.settings.shuffle_buffer

    def _count_manifest_retries(self) -> None:
        """The retries this process's read of the manifests took, before any counter existed: in
        training its counters' ``remote_retries`` (once per invocation: on top of a resumed sum)."""
        if self.plan.train and self.plan.shardset.read_retries:
            self._counts["remote_retries"] += self.plan.shardset.read_retries

    def resume(self, states: Sequence[LoaderState]) -> None:
        self._resume(states)
        self._count_manifest_retries()  # the resumed counters replaced those of __init__

    def _resume(self, states: Sequence[LoaderState]) -> None:
        """Continue where the loaders of a run stopped (before iterating): ``states`` are every old
        rank's (any order), as ``state()`` made them at one step, or on the same layout this rank's
        own alone. The same layout (world size, workers, micro batch, shuffle buffer) continues from
        this rank's state bit-exactly. Another layout (elastic resume): the rest of the interrupted
        epoch is the samples the old layout had not consumed, each once, with equal batches on every
        rank of this layout (fewer than one global batch of them dropped, counted by rank 0); then
        epochs follow this layout's plan. Cost: replaying the shuffle buffers of the old slots that
        feed this rank, about a microsecond per consumed sample, no I/O. Counters: rank 0 takes the
        old ranks' sum, so the sum over ranks carries on; the bad samples of the interrupted epoch
        are shared out over the new ranks (:meth:`_share_of_bad`), so the epoch's corrupt budget is
        not renewed by the resume. ``DataError`` for states of other data or seed, of different
        steps, or too few of them for another layout."""
        if not states:
            raise DataError("data loader resume: no states given")
        states = sorted(states, key=lambda st: st.rank)
        for st in states:
            self._check_same_data(st)
        first = states[0]
        for st in states[1:]:
            k = next((k for k in AGREED if getattr(st, k) != getattr(first, k)), None)
            if k is not None:
                raise DataError(f"data loader states disagree on {k}: rank {first.rank} has {getattr(first, k)!r}, "
                                f"rank {st.rank} has {getattr(st, k)!r} (states of one checkpoint step needed)")
        self._check_same_repeats(states)
        own = next((st for st in states if st.rank == self.rank), None)
        if first.layout == self._layout() and own is not None:
            self._continue(own)
            return
        ranks = [st.rank for st in states]
        if ranks != list(range(first.world_size)):
            raise DataError(f"data loader states: need one state per old rank 0..{first.world_size - 1}, got ranks "
                            f"{ranks}")
        total = Counter()
        for st in states:
            total.update(st.counters)
        self._counts = total if self.rank == 0 else Counter()
        emitted = [x for st in states for x in st.emitted]
        if not any(emitted) and first.rest is None:  # an epoch boundary: nothing to carry over
            self._reset_epoch(first.epoch)
            return
        source = {"epoch": first.epoch, "world_size": first.world_size, "workers": first.workers,
                  "batch_size": first.batch_size, "shuffle_buffer": first.shuffle_buffer, "emitted": emitted,
                  "rest": first.rest}
        self._reset_epoch(first.epoch, rest_epoch(self.plan, self.rank, source))
        self._epoch_bad = self._share_of_bad(states)
        if self.batches_this_epoch == 0:  # fewer left than one global batch of this layout
            self._end_epoch()

    def _share_of_bad(self, states: Sequence[LoaderState]) -> Counter:
        """This rank's share of the bad samples the old ranks met in the epoch so far: those samples,
        ordered by shard name, cut into ``world_size`` runs of equal length (within one), run ``rank``.
        The shares add up to the old counts, and each rank's due stays its full epoch's, so the
        epoch keeps the corrupt budget of an uninterrupted one: what the old ranks used is spent."""
        total: Counter = Counter()
        for st in states:
            total.update(st.epoch_bad_by_shard)
        n, world = sum(total.values()), self.plan.world_size
        lo, hi = n * self.rank // world, n * (self.rank + 1) // world
        share: Counter = Counter()
        at = 0
        for name in sorted(total):
            a, b = max(lo, at), min(hi, at + total[name])
            if b > a:
                share[name] = b - a
            at += total[name]
        return share

    def _check_same_data(self, state: LoaderState) -> None:
        """A data position applies only to the shards and seed it was saved with."""
        if state.seed != self.plan.seed:
            raise DataError(f"the checkpoint's data position was saved with train.seed={state.seed}, now "
                            f"{self.plan.seed}: resume with train.seed={state.seed}")
        now = self.plan.shardset.fingerprint()
        if state.data != now:
            raise DataError(f"the checkpoint's data position is for other shards than {self.plan.shardset.where} "
                            f"(their names and sample counts: {state.data} saved, {now} now): resume on the shards "
                            "it was saved with, or start a new run in another train.output_dir from its weights "
                            "(model.init_from=CHECKPOINT)")

    def _check_same_repeats(self, states: Sequence[LoaderState]) -> None:
        """``data.repeat_augment`` lays out the epoch's pool (``plan.py``): a position inside an
        epoch applies only to the count it was saved with; at an epoch boundary either goes on."""
        first = states[0]
        inside = first.rest is not None or any(x for st in states for x in st.emitted)
        if inside and first.repeats != self.plan.repeats:
            raise DataError(f"data loader state was saved inside epoch {first.epoch} with data.repeat_augment="
                            f"{first.repeats}, now {self.plan.repeats}: resume with {first.repeats} and change it "
                            f"at an epoch boundary")

    def _continue(self, state: LoaderState) -> None:
        """Exactly where ``state`` (of this rank, on this layout) stopped."""
        self._counts = Counter(state.counters)
        rest = rest_epoch(self.plan, self.rank, state.rest) if state.rest else None
        self._reset_epoch(state.epoch, rest)
        self._batch = state.batch
        self._emitted = list(state.emitted)
        self._epoch_bad = Counter(state.epoch_bad_by_shard)
