"""``data.synthetic``: random batches made on the training device, for measuring the training step
without the input pipeline (``benchmarks/vit_train_gpu.py``), as torchtitan's and timm's benchmark
modes do. No shard is read; the loss learns nothing.

A few batches of uint8 pixels and labels are drawn once from a generator seeded by ``seed`` and
the rank, normalised as the shard loader normalises (``augment.mean`` / ``std``) and handed out in
turn, so a step costs the device nothing beyond the model's own work. The position (batches
handed out) is the loader's state: a resumed run continues the same sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from data_pipeline.errors import DataError

POOL = 4  # distinct batches handed out in turn
STATE_KIND = "synthetic"


class SyntheticLoader:
    """An endless stream of ``(images, targets)`` on ``device``: images ``(batch, 3, img, img)``
    float32, normalised; targets class indices, or multi-hot rows with ``multi_label``."""

    worker_decoder = "none (data.synthetic: random batches on the device)"
    epochs_done = None  # no data set, so no epochs
    decode_path = "data.synthetic: nothing decoded (random batches on the device)"

    def __init__(self, data_cfg, *, batch_size: int, img_size: int, num_classes: int, seed: int, rank: int,
                 device: Optional[torch.device] = None):
        if num_classes is None or num_classes < 1:
            raise DataError(f"data.synthetic needs the model's class count, got {num_classes!r}")
        self.num_classes, self.rank, self.batches = num_classes, rank, 0
        self.last_keys: list[str] = []
        self.last_epoch = 0
        self._make = dict(cfg=data_cfg, batch_size=batch_size, seed=seed, device=torch.device(device or "cpu"))
        self.img_size = img_size
        self._pool = self._draw(img_size)

    def _draw(self, img_size: int) -> list:
        """The batches handed out in turn at ``img_size`` px, drawn afresh from (seed, rank)."""
        cfg, batch_size, device = self._make["cfg"], self._make["batch_size"], self._make["device"]
        g = torch.Generator().manual_seed(self._make["seed"] * 1_000_003 + self.rank)
        mean = torch.tensor(cfg.augment.mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(cfg.augment.std, dtype=torch.float32).view(1, 3, 1, 1)
        pool = []
        for _ in range(POOL):
            pixels = torch.randint(0, 256, (batch_size, 3, img_size, img_size), generator=g, dtype=torch.uint8)
            images = (pixels.float() / 255.0 - mean) / std
            labels = torch.randint(0, self.num_classes, (batch_size,), generator=g)
            if cfg.multi_label:
                labels = torch.nn.functional.one_hot(labels, self.num_classes).float()
            pool.append((images.to(device), labels.to(device)))
        return pool

    def set_img_size(self, img_size: int) -> None:
        """Batches at ``img_size`` px from the next iterator on (``train.resolution_schedule``); the
        position is kept."""
        if img_size != self.img_size:
            self.img_size, self._pool = img_size, self._draw(img_size)

    @property
    def counters(self) -> dict:
        return {"samples": self.batches * self._pool[0][0].shape[0]}

    def __iter__(self):
        while True:
            batch = self._pool[self.batches % POOL]
            self.batches += 1
            yield batch

    # ---------------------------------------------------------------------------------- resume
    def state(self) -> "SyntheticState":
        return SyntheticState(self.batches)

    def resume(self, states: list["SyntheticState"]) -> None:
        """This rank's saved position (the same world size) or, on another world size, rank 0's."""
        self.batches = (states[self.rank] if self.rank < len(states) else states[0]).batches


@dataclass(frozen=True)
class SyntheticState:
    """The synthetic loader's position: batches handed out. Stored in checkpoints as a small dict."""
    batches: int

    def to_dict(self) -> dict:
        return {"kind": STATE_KIND, "batches": self.batches}

    @classmethod
    def from_dict(cls, d) -> "SyntheticState":
        if not isinstance(d, dict) or d.get("kind") != STATE_KIND:
            raise DataError("the checkpoint's data position is a shard loader's; data.synthetic cannot continue it")
        return cls(int(d["batches"]))
