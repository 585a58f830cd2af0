"""A rank's data position as its checkpoint stores it (:class:`LoaderState`): made by
``ShardLoader.state()``, continued by ``ShardLoader.resume``."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from data_pipeline.errors import DataError

# 2: sample-range plan; adds shuffle_buffer and rest (the elastic source of a rest-epoch).
STATE_VERSION = 2
# what the states of all ranks of one checkpoint step share
AGREED = ("epoch", "batch", "world_size", "workers", "batch_size", "shuffle_buffer", "rest", "repeats")


@dataclass(frozen=True)
class LoaderState:
    """Where one rank's loader stands after the last batch it yielded. Exact resume needs only the
    first three fields; the layout (``world_size`` .. ``shuffle_buffer``) says whether this rank's
    state alone continues a run or every old rank's is needed; ``seed`` and ``data`` that the
    position applies at all. ``to_dict`` / ``from_dict``: the checkpoint's JSON (version 2)."""
    epoch: int
    batch: int  # batches of this rank yielded in ``epoch``
    emitted: tuple  # per worker role: shuffle-buffer emissions consumed in ``epoch`` (corrupt ones included)
    rank: int
    world_size: int
    workers: int  # reader slots per rank (data.workers, at least 1)
    batch_size: int
    seed: int
    shuffle_buffer: int
    data: str  # the shard set's fingerprint
    rest: Optional[dict] = None  # the source of the rest-epoch being read (remainder.rest_epoch), or None
    counters: dict = field(default_factory=dict)  # loader.counters so far
    epoch_bad_by_shard: dict = field(default_factory=dict)  # shard name -> bad samples of ``epoch``
    repeats: int = 1  # data.repeat_augment: the pool ``emitted`` counts in (a state without it: 1)

    @property
    def layout(self) -> tuple:
        return self.world_size, self.workers, self.batch_size, self.shuffle_buffer

    def to_dict(self) -> dict:
        """The checkpoint's JSON object: ``version`` and every field (``emitted`` as a list)."""
        out = {"version": STATE_VERSION}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        out["emitted"] = list(self.emitted)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "LoaderState":
        """A state as ``to_dict`` wrote it (any checkpoint of version 2). ``DataError`` in one line for
        another version or a missing field."""
        version = d.get("version")
        if version == 1:
            raise DataError("data loader state version 1 (the shard-level plan) cannot be resumed by this loader: "
                            "start a new run (another train.output_dir), with model.init_from=<this run's "
                            "directory> to keep its weights")
        if version != STATE_VERSION:
            raise DataError(f"data loader state: unsupported version {version!r} (expected {STATE_VERSION})")
        try:
            return cls(int(d["epoch"]), int(d["batch"]), tuple(int(x) for x in d["emitted"]), int(d["rank"]),
                       int(d["world_size"]), int(d["workers"]), int(d["batch_size"]), int(d["seed"]),
                       int(d["shuffle_buffer"]), str(d["data"]), d.get("rest"), dict(d.get("counters") or {}),
                       dict(d.get("epoch_bad_by_shard") or {}), int(d.get("repeats", 1)))
        except KeyError as e:
            raise DataError(f"data loader state (version {STATE_VERSION}) lacks {e.args[0]!r}") from None
