"""What travels with each batch beside its pixels (:class:`BatchRecord`), and what becomes of the
samples the training process fails to decode.

A JPEG that fails to decode in the training process (``data.decode_device`` cpu, cuda or dali) is
retried alone and then through the worker path (PIL) by the decoder; one that fails both is counted
as ``corrupt_image`` of its shard (against ``data.max_corrupt_rate``; once, not again on a repeat
pass: :meth:`BatchRecord.count_corrupt`). In training its place in the batch is taken by a copy of
another sample of the batch (of the previous batch's last good one when none is left), counted as
``repeated_for_balance``, so every rank still yields batches of the same shape; its key in
``loader.last_keys`` is the copied sample's (:meth:`BatchRecord.refill`). In evaluation it is
dropped, as the worker path does (:meth:`BatchRecord.drop`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from data_pipeline.errors import TooManyCorruptSamples


class Spare(NamedTuple):
    """Training: the last good sample of a batch, for a later batch none of whose samples decoded."""
    image: torch.Tensor
    target: torch.Tensor
    key: str
    shard: str


@dataclass
class BatchRecord:
    """A batch's bookkeeping: made by its worker (``stream.SlotStream``), amended by the decoder
    where samples failed, read by the loader (``ShardLoader``) once the batch is finished. A record
    with ``error`` comes without a batch: the worker cannot go on and the loader raises it."""
    train: bool  # training (the batch moves the resume position) or evaluation (it does not)
    role: int  # the worker role (0..workers-1) that made the batch
    tally: dict  # the role's counters since its previous batch (``Tally.take``)
    epoch: int = 0  # training: the epoch the batch belongs to
    emitted: int = 0  # training: the role's shuffle-buffer emissions this epoch, corrupt ones included
    keys: list = field(default_factory=list)  # each sample's __key__
    shards: list = field(default_factory=list)  # ... and its shard's name
    positions: list = field(default_factory=list)  # evaluation: ... and its position in manifest order
    error: Optional[str] = None  # why the role stopped (a DataError's line)
    unreachable: bool = False  # ... because the store stayed away past data.remote_retry_s (exit 69)

    def count_corrupt(self, rows: list, items: list) -> None:
        """The samples at ``rows`` failed to decode (``items``: the batch's Deferred records): each
        joins the tally as ``corrupt_image`` of its shard, unless an earlier pass over the same
        sample counted it (``Deferred.counted``)."""
        counts, by_shard = self.tally["counts"], self.tally["bad_by_shard"]
        for i in rows:
            if items[i].counted:
                counts["corrupt_image"] = counts.get("corrupt_image", 0) + 1
                by_shard[self.shards[i]] = by_shard.get(self.shards[i], 0) + 1

    def drop(self, good: list, images: torch.Tensor, targets: torch.Tensor,
             upload: Callable[[torch.Tensor], torch.Tensor]) -> tuple:
        """Evaluation: the batch of only the rows ``good`` (in order), a short one as the worker path
        gives; (None, None) when none is left. ``upload`` moves the row index to the images' device."""
        self.keys, self.shards = [self.keys[i] for i in good], [self.shards[i] for i in good]
        self.positions = [self.positions[i] for i in good] if self.positions else []
        if not good:
            return None, None
        rows = upload(torch.tensor(good))
        return images.index_select(0, rows), targets.index_select(0, rows)

    def refill(self, bad: list, good: list, images: torch.Tensor, targets: torch.Tensor,
               spare: Optional[Spare], where: str) -> Optional[Spare]:
        """Training: each failed row of ``bad`` takes, in place, a copy of a good row of the batch
        (in turn), or in a batch with none, ``spare`` (the last good sample of an earlier batch),
        counted as ``repeated_for_balance``; keys and shards follow. Returns the spare for the next
        batch: a copy of this batch's last good row (``spare`` when it has none). Raises
        ``TooManyCorruptSamples`` when nothing can fill a row (``where``: the decoding device)."""
        if bad and not good and spare is None:
            raise TooManyCorruptSamples(f"none of the {len(bad)} JPEGs of the first batch decoded on {where} "
                                        f"(shards: {', '.join(sorted(set(self.shards[i] for i in bad)))})")
        counts = self.tally["counts"]
        for k, i in enumerate(bad):
            if good:
                src = good[k % len(good)]
                image, target, key, shard = images[src], targets[src], self.keys[src], self.shards[src]
            else:
                image, target, key, shard = spare
            images[i].copy_(image)
            targets[i] = target
            self.keys[i], self.shards[i] = key, shard
            counts["repeated_for_balance"] = counts.get("repeated_for_balance", 0) + 1
        if not good:
            return spare
        last = good[-1]
        return Spare(images[last].clone(), targets[last].clone(), self.keys[last], self.shards[last])
