"""The ``data:`` section of an experiment config: its schema and its checks.

The data pipeline consumes this section (``build_loader(cfg.data, ...)``), so it owns it;
``pretrain.config`` assembles the whole experiment schema from the sections and does the YAML
loading, type checking and error messages that name the file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

__all__ = ["AugmentConfig", "DataConfig", "check_data"]

DEVICES = ("worker", "cpu", "cuda")  # data.decode_device


@dataclass
class AugmentConfig:
    # Inception-style random resized crop (the paper's pre-processing) + horizontal flip.
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    crop_ratio: list[float] = field(default_factory=lambda: [0.75, 1.3333333])
    hflip: float = 0.5
    # AugReg recipe (Steiner et al. 2021): RandAugment(num_ops, magnitude), Mixup / CutMix.
    randaugment_ops: int = 0  # 0 disables RandAugment
    randaugment_magnitude: int = 10
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    # Normalisation: big_vision / the ViT paper map pixels to [-1, 1].
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    eval_crop_pct: float = 0.875


@dataclass
class DataConfig:
    # Brace pattern ("shards/train-{000000..000127}.tar"), a list of URLs, or a manifest.json path.
    train_shards: Union[str, list[str], None] = None
    val_shards: Union[str, list[str], None] = None
    img_size: Optional[int] = None  # None: the model's resolution
    workers: int = 4
    shuffle_buffer: int = 2000
    multi_label: bool = False  # sigmoid targets from <key>.json labels (ImageNet-21k / JFT style)
    allow_remote: bool = False  # permit pipe:, http(s)://, s3://, gs:// URLs
    # http(s) shards: a failed connect/read is retried with backoff (0.25 s doubling, at most 8 s)
    # and resumes at its byte; the run stops after this many failures in a row, or after one
    # outage lasted remote_retry_s; a connect or read that waits remote_timeout_s is a failure
    remote_retries: int = 8
    remote_retry_s: float = 120.0
    remote_timeout_s: float = 30.0
    max_corrupt_rate: float = 0.01  # stop the run when more than this share of samples is bad
    max_image_pixels: int = 89_478_485  # decompression-bomb guard (PIL's default limit)
    prefetch_factor: int = 2
    # where JPEGs are decoded: "worker" (PIL in the dataloader workers), or "cuda" / "cpu": the
    # training process decodes each batch with torchvision's decode_jpeg (nvJPEG on a GPU) and
    # crops, flips, normalises there; workers only read and pick crop boxes (batch_decode.py)
    decode_device: str = "worker"
    # write step<TAB>epoch<TAB>key per consumed sample to <output_dir>/samples/rank-<R>.tsv
    record_samples: bool = False
    # a file of sample keys to skip, one per line (vit-audit's exclude.txt): never decoded,
    # counted as ``excluded``
    exclude_keys: Optional[str] = None
    augment: AugmentConfig = field(default_factory=AugmentConfig)


def check_data(data: DataConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    if data.workers < 0:
        fail("data.workers", f"must be >= 0, got {data.workers}")
    if not 0.0 <= data.max_corrupt_rate <= 1.0:
        fail("data.max_corrupt_rate", f"must be in [0, 1], got {data.max_corrupt_rate}")
    if data.remote_retries < 0:
        fail("data.remote_retries", f"must be >= 0, got {data.remote_retries}")
    for key in ("remote_retry_s", "remote_timeout_s"):
        if not getattr(data, key) > 0:
            fail(f"data.{key}", f"must be > 0 seconds, got {getattr(data, key)}")
    if data.decode_device not in DEVICES:
        fail("data.decode_device", f"must be one of {', '.join(DEVICES)}, got {data.decode_device!r}")
    a = data.augment
    if len(a.crop_scale) != 2 or not 0 < a.crop_scale[0] <= a.crop_scale[1] <= 1:
        fail("data.augment.crop_scale", f"must be [min, max] with 0 < min <= max <= 1, got {a.crop_scale}")
    if len(a.mean) != 3 or len(a.std) != 3 or min(a.std) <= 0:
        fail("data.augment.std", "mean and std need 3 channels, std > 0")
