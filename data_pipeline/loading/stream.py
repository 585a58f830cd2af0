"""What one dataloader worker runs: its slot's sample ranges -> shuffle buffer -> safe decode -> batches.

A worker plays one *role* (0..workers-1) of its rank; slot = rank * workers + role. Each emitted
batch carries a ``batch.record.BatchRecord``: the epoch, the role, how many samples the role's
shuffle buffer has emitted so far this epoch (corrupt ones included), the counter delta since the
previous batch, and the ``__key__`` and shard name of each sample in the batch (in evaluation also
its position in manifest order). The main process
(``loader.ShardLoader``) keeps those numbers for the batches it has *yielded*, which is the whole
resume state:

* Fast-forward: a resumed role replays its epoch stream -- reading tar members, never decoding --
  and discards the first ``emitted`` samples of the shuffle buffer's output. The buffer's choices
  depend only on its seed and the arrival count, so it reaches exactly the state it had.
* Rotation: the torch DataLoader asks worker 0, 1, 2, ... in turn, so the ``j``-th batch of an
  iterator comes from dataloader worker ``j % workers``, and rank batch ``b`` of an epoch must come
  from role ``b % workers`` (role ``r`` yields ``len(range(r, q, workers))`` of the rank's ``q``
  batches, see ``plan.py``). A dataloader worker therefore works out its role afresh in every
  epoch from where that epoch starts in its iterator's sequence.
* Rest-epoch: after an elastic resume the first epoch reads what the old layout left
  (``remainder.RestEpoch``: per-role pieces and batch count); later epochs follow the plan.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline.config import AugmentConfig
from data_pipeline.loading.batch.buffers import BatchBuffers
from data_pipeline.loading.batch.record import BatchRecord
from data_pipeline.loading.batch.wire import DeferredBatch
from data_pipeline.loading.plan import TAG_BATCH, TAG_SAMPLE, Plan, mix_seed, shuffle_seed
from data_pipeline.loading.transforms import SampleTransform
from data_pipeline.shards.decode import BadSample, image_bytes, open_image, parse_label
from data_pipeline.shards.reader import read_shard
from data_pipeline.storage.retry import RemotePolicy, RemoteShardError, StoreUnreachable
from data_pipeline.tally import Tally

SHUFFLE_INITIAL = 100  # start emitting once this many samples are buffered (as webdataset does)


@dataclass(frozen=True)
class Settings:
    augment: AugmentConfig
    img_size: int
    shuffle_buffer: int
    max_image_pixels: int
    multi_label: bool
    exclude: frozenset = frozenset()  # data.exclude_keys: keys skipped before decoding
    decode_device: str = "worker"  # data.decode_device: "worker", or where the training process decodes
    worker_decoder: str = "pil"  # data.worker_decoder, resolved: "nvimgcodec" (crop window only) or "pil"
    remote: RemotePolicy = RemotePolicy()  # data.remote_*: retries of http(s) shards

    def mixing(self, train: bool) -> bool:
        return train and (self.augment.mixup_alpha > 0 or self.augment.cutmix_alpha > 0)


@dataclass(frozen=True)
class Start:
    epoch: int
    batch: int  # batches of this rank already yielded in ``epoch``
    emitted: tuple  # per role: shuffle-buffer emissions consumed in ``epoch``
    rest: object = None  # remainder.RestEpoch when ``epoch`` is the rest of an epoch after an elastic resume


class ShuffleBuffer:
    """Random-pick shuffle buffer (emit a uniformly chosen buffered item): its choices depend only
    on the RNG and the arrival count."""

    def __init__(self, size: int, rng: random.Random):
        self.size, self.rng, self.items = size, rng, []

    def __call__(self, source):
        it = iter(source)
        initial = min(SHUFFLE_INITIAL, self.size)
        for item in it:
            self.items.append(item)
            if len(self.items) < self.size:  # grow by one extra read per emission until full
                extra = next(it, None)
                if extra is not None:
                    self.items.append(extra)
            if len(self.items) >= initial:
                yield self._pop()
        while self.items:
            yield self._pop()

    def _pop(self):
        i = self.rng.randrange(len(self.items))
        self.items[i], self.items[-1] = self.items[-1], self.items[i]
        return self.items.pop()


def sample_seed(seed: int, epoch: int, raw, pass_no: int) -> int:
    """The seed of a sample's augmentation: its identity in the epoch, whichever slot reads it.
    A repeat (``data.repeat_augment``) adds its copy number; copy 0 keeps the seed it has without."""
    return mix_seed(TAG_SAMPLE, seed, epoch, raw.shard.index, raw.index, pass_no, *([raw.copy] if raw.copy else []))


class _Starved(Exception):
    pass


def _quiet() -> Tally:
    """A tally that counts nothing: for events the first pass (or the first run) already counted."""
    t = Tally()
    t.enabled = False
    return t


class _SlotReader:
    """A slot's pieces in order, one sequential read per run of pieces of the same shard; in
    training, further passes if bad samples ate the slot's slack (so the rank still yields its
    promised batch count). Tracks what pass 0 has accounted for. Every planned position arrives,
    a sample the tar did not deliver as a ``lost`` placeholder (already counted)."""

    def __init__(self, pieces, tally: Tally, repeat: bool, exclude: frozenset = frozenset(),
                 remote: RemotePolicy = RemotePolicy()):
        self.pieces, self.tally, self.repeat, self.exclude = list(pieces), tally, repeat, exclude
        self.remote = remote
        self.accounted = 0  # pass-0 arrivals so far (placeholders of lost samples included)
        self.pass_no = 0

    @property
    def total(self) -> int:
        return sum(p.samples for p in self.pieces)

    @property
    def shards(self):
        return [p.shard for p in self.pieces]

    def passes(self):
        """Yields one sample iterator per pass; the consumer exhausts each before the next."""
        while True:
            got = [0]
            yield self._one_pass(got)
            if not self.repeat:
                return
            if got[0] == 0:
                raise _Starved()
            self.pass_no += 1

    def _runs(self):
        """(shard, copy, [(lo, hi), ...]) for each run of consecutive pieces of one shard and copy."""
        runs = []
        for p in self.pieces:
            if runs and runs[-1][0] is p.shard and runs[-1][1] == p.copy:
                runs[-1][2].append((p.lo, p.hi))
            else:
                runs.append((p.shard, p.copy, [(p.lo, p.hi)]))
        return runs

    def _one_pass(self, got):
        first = self.pass_no == 0
        for shard, copy, ranges in self._runs():
            # repeated passes re-read the same bytes: their shard events were counted already (not
            # the requests they make again: Tally.muted)
            for sample in read_shard(shard, self.tally if first else self.tally.muted(), ranges, self.remote):
                got[0] += not sample.lost and sample.key not in self.exclude  # all excluded: starved
                self.accounted += first
                sample.copy = copy
                yield sample


def shuffled(reader: _SlotReader, buffer: "ShuffleBuffer"):
    """(pass, sample) in shuffled order; the buffer drains at the end of each pass so that no
    repeated sample comes out while first-pass samples still wait in the buffer."""
    for samples in reader.passes():
        for raw in buffer(samples):
            yield reader.pass_no, raw


class SlotStream(IterableDataset):
    def __init__(self, plan: Plan, rank: int, settings: Settings, start: Start, num_classes: int,
                 buffers: Optional[BatchBuffers] = None):
        self.plan, self.rank, self.settings, self.start = plan, rank, settings, start
        self.buffers = buffers  # where workers stack their batches (None: fresh shared memory each)
        self.num_classes = num_classes
        self.transform = SampleTransform(settings.augment, settings.img_size, plan.train,
                                         window=settings.worker_decoder == "nvimgcodec")

    def __iter__(self):
        info = get_worker_info()
        dl_id = info.id if info is not None else 0
        W = self.plan.workers
        if not self.plan.train:
            yield from self._eval_pass(self.rank * W + dl_id, dl_id)
            return
        # Dataloader worker ``dl_id`` yields the iterator's batches j = dl_id, dl_id + W, ...; an
        # epoch whose rank batch ``b0`` is the iterator's batch ``j0`` needs it as role (dl_id - j0 + b0) % W.
        plan, start = self.plan, self.start
        epoch, j0, b0, rest, skips = start.epoch, 0, start.batch, start.rest, start.emitted
        while True:
            q = rest.batches if rest is not None else plan.epoch_batches()
            role = (dl_id - j0 + b0) % W
            done, due = plan.role_batches(b0, role), plan.role_batches(q, role)
            if done < due:
                slot = self.rank * W + role
                pieces = rest.pieces[role] if rest is not None else plan.slot_pieces(epoch, slot)
                level = rest.level if rest is not None else 0
                for item in self._train_epoch(epoch, slot, role, pieces, level, done, skips[role], due):
                    yield item
                    if item[2].error is not None:  # the main process raises; nothing more to read
                        return
            epoch, j0, b0, rest, skips = epoch + 1, j0 + q - b0, 0, None, (0,) * W

    # -------------------------------------------------------------------------------- training
    def _train_epoch(self, epoch, slot, role, pieces, level, done, skip, per_slot):
        plan, s = self.plan, self.settings
        tally = Tally()
        tally.enabled = skip == 0  # events before the resume point were counted by the first run
        # (but for remote_retries: the fast-forward's requests are this run's own, tally.ALWAYS_KINDS)
        reader = _SlotReader(pieces, tally, repeat=True, exclude=s.exclude, remote=s.remote)
        buffer = ShuffleBuffer(s.shuffle_buffer, random.Random(shuffle_seed(plan.seed, epoch, slot, level)))
        images, labels, keys, shards, emitted = [], [], [], [], 0
        good_pass = -1  # the last pass that decoded a sample (a fast-forwarded one did, in the first run)
        try:
            for pass_no, raw in shuffled(reader, buffer):
                emitted += 1
                if emitted <= skip:  # fast-forward: no decode
                    tally.enabled = emitted == skip
                    good_pass = pass_no
                    continue
                if pass_no > good_pass + 1:  # a whole pass of samples none of which decodes: the slot's
                    raise _Starved()  # batches can never fill, and repeating it would spin for ever
                seed = sample_seed(plan.seed, epoch, raw, pass_no)
                # a repeated pass meets the same bad samples again: they were counted the first time
                item = self._decode(raw, seed, tally if pass_no == 0 else _quiet())
                if item is None:
                    continue
                good_pass = pass_no
                if pass_no > 0:
                    tally.add("repeated_for_balance")
                images.append(item[0])
                labels.append(item[1])
                keys.append(raw.key)
                shards.append(raw.shard.name)
                if len(images) < plan.batch_size:
                    continue
                done += 1
                if done == per_slot:  # whatever the slot still holds is dropped for balance (none
                    # unless the tar held more than planned: a slot's range is a whole number of batches)
                    in_buffer = len(buffer.items) if pass_no == 0 else 0
                    tally.add("dropped_for_balance", reader.total - reader.accounted + in_buffer)
                record = BatchRecord(True, role, tally.take(), epoch, emitted, keys, shards)
                batch_seed = mix_seed(TAG_BATCH, plan.seed, epoch, slot, done, *([level] if level else []))
                yield self._collate(images, labels, batch_seed) + (record,)
                images, labels, keys, shards = [], [], [], []
                if done == per_slot:
                    return
        except _Starved:
            names = ", ".join(sh.name for sh in reader.shards)
            yield None, None, BatchRecord(True, role, tally.take(), epoch, error=(
                f"rank {self.rank} reader slot {role}: none of its shards ({names}) yielded a readable "
                f"sample in epoch {epoch}"))
        except (RemoteShardError, StoreUnreachable) as e:  # the main process raises it (one line)
            yield None, None, BatchRecord(True, role, tally.take(), epoch, error=str(e),
                                          unreachable=isinstance(e, StoreUnreachable))

    # ------------------------------------------------------------------------------ evaluation
    def _eval_pass(self, slot, role):
        tally = Tally()
        pieces = self.plan.slot_pieces(0, slot)
        (samples,) = _SlotReader(pieces, tally, repeat=False, remote=self.settings.remote).passes()
        try:
            yield from self._eval_batches(samples, role, tally)
        except (RemoteShardError, StoreUnreachable) as e:
            yield None, None, BatchRecord(False, role, tally.take(), error=str(e),
                                          unreachable=isinstance(e, StoreUnreachable))

    def _eval_batches(self, samples, role, tally):
        plan = self.plan
        starts = plan.shard_starts(0)  # a sample's position: where the consumer puts its row back
        images, labels, keys, shards, positions = [], [], [], [], []
        for raw in samples:
            item = self._decode(raw, 0, tally)
            if item is not None:
                images.append(item[0])
                labels.append(item[1])
                keys.append(raw.key)
                shards.append(raw.shard.name)
                positions.append(starts[raw.shard.index] + raw.index)
            if len(images) == plan.batch_size:
                record = BatchRecord(False, role, tally.take(), keys=keys, shards=shards, positions=positions)
                yield self._collate(images, labels, 0) + (record,)
                images, labels, keys, shards, positions = [], [], [], [], []
        delta = tally.take()
        if images:
            record = BatchRecord(False, role, delta, keys=keys, shards=shards, positions=positions)
            yield self._collate(images, labels, 0) + (record,)
        elif delta["counts"]:  # counters of a tail without good samples still reach the main process
            yield None, None, BatchRecord(False, role, delta)

    # -------------------------------------------------------------------------------- samples
    def _decode(self, raw, seed, tally):
        if raw.lost:  # placeholder of a sample the tar did not deliver: counted when the read ended
            return None
        if raw.key in self.settings.exclude:  # data.exclude_keys: skipped unread, counted
            tally.add("excluded")
            return None
        try:
            label = parse_label(raw.members, self.num_classes, self.settings.multi_label)
            data = image_bytes(raw.members)
            if data is not None and self.settings.decode_device == "worker":  # most plain JPEGs: no PIL
                out = self.transform.window_sample(data, seed, self.settings.max_image_pixels)
                if out is not None:
                    return out, label
            img = open_image(raw.members, self.settings.max_image_pixels)
            if self.settings.decode_device != "worker":  # the training process decodes plain JPEGs
                deferred = self.transform.defer(img, data, seed, counted=tally.enabled)
                if deferred is not None:
                    return deferred, label
            return self.transform(img, seed, data), label
        except BadSample as e:
            tally.bad(e.kind, raw.shard.name)
            return None

    def _collate(self, images, labels, batch_seed):
        s = self.settings
        if s.multi_label:
            y = torch.zeros(len(labels), self.num_classes)
            for i, lab in enumerate(labels):
                y[i, lab] = 1.0
        else:
            y = torch.tensor(labels, dtype=torch.int64)
        # uint8 samples (and, with data.decode_device cpu/cuda/dali, JPEG files): the training
        # process decodes what is left, normalises and mixes (batch.decode.BatchDecoder)
        return DeferredBatch.pack(images, batch_seed if s.mixing(self.plan.train) else None, self.buffers), y
