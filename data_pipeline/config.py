"""The ``data:`` section of an experiment config: its schema and its checks.

The data pipeline consumes this section (``build_loader(cfg.data, ...)``), so it owns it;
``pretrain.config`` assembles the whole experiment schema from the sections and does the YAML
loading, type checking and error messages that name the file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

__all__ = ["AugmentConfig", "DataConfig", "check_data", "backoff_s", "outage_retries"]

DEVICES = ("worker", "cpu", "cuda", "dali")  # data.decode_device
WORKER_DECODERS = ("auto", "nvimgcodec", "pil")  # data.worker_decoder
BACKOFF_FIRST_S = 0.25  # data.remote_*: the wait after a remote failure, doubling per failure in a row
BACKOFF_MAX_S = 8.0  # ... up to this


@dataclass
class AugmentConfig:
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    """Inception-style random resized crop (the paper's pre-processing): range of the crop's share
    of the image area."""
    crop_ratio: list[float] = field(default_factory=lambda: [0.75, 1.3333333])
    """Random resized crop: range of the crop's aspect ratio."""
    hflip: float = 0.5
    """Probability of a horizontal flip."""
    randaugment_ops: int = 0
    """AugReg recipe (Steiner et al. 2021): RandAugment's number of ops (torchvision's
    `v2.RandAugment`); 0 disables RandAugment."""
    randaugment_magnitude: int = 10
    """RandAugment's magnitude M, torchvision's `v2.RandAugment` (31 bins: 0-30) with its op set and
    probabilities: each op drawn from its 14 (Identity among them) and applied, geometric ops and
    colour factors with a random sign, uncovered pixels black. M rotates M degrees, shears 0.01 M,
    translates M / 30 x 150 / 331 of the side, sets brightness, colour, contrast and sharpness
    factors to 1 +- 0.03 M, posterizes to 8 - round(M / 7.5) bits and solarizes above
    255 (1 - M / 30). A level L of big_vision's or timm's 0-10 scale rotates and shears as M = 3L
    does; the rest differs. big_vision's `randaug(2, L)` also draws Invert, Cutout and SolarizeAdd,
    fills with grey 128, solarizes above 25.6 L (nothing at 10), keeps int(0.4 L) bits and sets
    colour factors to 0.1 + 0.18 L (1.9 at 10, never a random sign). timm's `rand-mL` applies each
    drawn op with probability 0.5, also draws Invert and SolarizeAdd, fills with the mean pixel and
    has big_vision's solarize, posterize and colour factors; with `inc1` its colour factors are
    1 +- 0.09 L, as M = 3L here, and it posterizes to 4 - int(0.4 L) bits."""
    three_augment: bool = False
    """DeiT III's 3-Augment instead of RandAugment: after the crop and flip, one of grayscale,
    solarization or Gaussian blur (radius 0.1..2) chosen uniformly per image, then colour jitter 0.3
    (brightness, contrast, saturation), each op pixel for pixel PIL's as DeiT III applies them;
    with every `data.decode_device` (data_pipeline/DATA.md)."""
    mixup_alpha: float = 0.0
    """Mixup's alpha (AugReg); 0 = off."""
    cutmix_alpha: float = 0.0
    """CutMix's alpha (AugReg); 0 = off."""
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    """Normalisation mean per channel: big_vision / the ViT paper map pixels to [-1, 1]."""
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    """Normalisation standard deviation per channel."""
    eval_crop_pct: float = 0.875
    """Evaluation: the shorter side is resized to `img_size / eval_crop_pct`, then the centre
    crop is taken."""


@dataclass
class DataConfig:
    train_shards: Union[str, list[str], None] = None
    """Brace pattern (`dir/train-{000000..000999}.tar`), a folder, a list of URLs, or a
    `manifest.json`; each shard named once (a set named again is refused: it would not be weighted)."""
    val_shards: Union[str, list[str], None] = None
    """The same, for the evaluation while training (`validation.every_steps`): labels of the training
    head, so their manifest lists the training shards' classes in the same order (checked at start-up
    and by `vit-launch check`)."""
    synthetic: bool = False
    """Train on random batches made on the training device instead of shards (no files read, the
    loss learns nothing): measures the training step without the input pipeline
    (`benchmarks/vit_train_gpu.py`)."""
    img_size: Optional[int] = None
    """Loader resolution; null: the model's resolution. A training config may only repeat the model's
    (`model.img_size` or the name's; another is refused at load): to train at fewer pixels, set
    `model.img_size` or `train.resolution_schedule`."""
    workers: int = 4
    """DataLoader worker processes per rank."""
    shuffle_buffer: int = 2000
    """Samples per shuffle buffer (per worker)."""
    multi_label: bool = False
    """Sigmoid targets from `<key>.json` labels (ImageNet-21k / JFT style). Multi-label shards need it
    (they keep each sample's first label as `.cls` too, which alone would train: refused at start-up);
    on single-label shards it trains sigmoid targets of one class (big_vision's ImageNet-21k recipe)."""
    allow_remote: bool = False
    """Permit `pipe:`, `http(s)://`, `s3://`, `gs://` shard URLs (`s3://`: boto3's AWS_* chain)."""
    remote_retry_s: float = 120.0
    """`http(s)://` and `s3://` shards: a failure (refused connect, dropped or stalled read,
    408/429/5xx, S3 SlowDown) starts an outage, retried with backoff (0.25 s doubling, at most 8 s)
    until it has lasted this long, waits included; a read resumes at its byte, and an outage past
    this ends the run with exit 69 (data_pipeline/DATA.md, "Shards over HTTP")."""
    remote_retries: Optional[int] = None
    """A guard, not a bound: the most failures one outage may count before it ends (a loop failing
    faster than the clock); null: as many as the backoff takes to fill `data.remote_retry_s`. A
    number that would end an outage sooner than that is refused."""
    remote_timeout_s: float = 30.0
    """A connect or a read of an `http(s)://` or `s3://` shard that waits this long counts as a failure."""
    max_corrupt_rate: float = 0.01
    """Stop the run when more than this share of samples is bad."""
    max_image_pixels: int = 89_478_485
    """Decompression-bomb guard: larger images are refused (PIL's default limit)."""
    prefetch_factor: int = 2
    """Batches each DataLoader worker prepares ahead."""
    decode_device: str = "worker"
    """Where JPEGs are decoded: `worker` (the data workers), `cuda` (the training process, on the
    GPU, torchvision's nvJPEG), `dali` (the training process, an NVIDIA DALI pipeline: on the GPU,
    or on the CPU where there is none; `pip install nvidia-dali-cuda130`) or `cpu` (the training
    process, on the CPU); what each does: data_pipeline/DATA.md."""
    worker_decoder: str = "auto"
    """How a data worker decodes a training JPEG: `nvimgcodec` decodes only the random crop's rows
    and columns (NVIDIA nvImageCodec's CPU backend, `pip install nvidia-nvimgcodec-cu13`; no GPU
    needed), `pil` the whole image with PIL; `auto`: `nvimgcodec` when it is installed, else `pil`.
    The crop boxes, and so resume, are the same either way (data_pipeline/DATA.md)."""
    repeat_augment: int = 1
    """Repeated augmentation (DeiT's `RASampler`, which uses 3): an epoch keeps its length, N
    draws, but draws the first ceil(N / k) samples of its shuffled sequence k times each, each copy
    augmented afresh and, when there are at least k ranks, each on another rank; 1 = off. Resume,
    elastic resume and the sample log count copies (data_pipeline/DATA.md)."""
    record_samples: bool = False
    """Write `step<TAB>epoch<TAB>key` per consumed sample to `<output_dir>/samples/rank-<R>.tsv`
    (cut back to the checkpoint's step on resume)."""
    exclude_keys: Optional[str] = None
    """A file of sample keys to skip, one per line (vit-audit's `exclude.txt`): never decoded,
    counted as `excluded`."""
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    """Training augmentation and normalisation (the paper's by default)."""


def backoff_s(failures: int) -> float:
    """The wait after the ``failures``-th failure in a row of one remote outage."""
    return min(BACKOFF_FIRST_S * 2 ** min(failures - 1, 32), BACKOFF_MAX_S)


def outage_retries(retry_s: float) -> int:
    """The retries one outage of ``retry_s`` seconds takes when every try fails at once: the fewest
    that ``data.remote_retries`` may allow without ending outages before ``data.remote_retry_s``."""
    n, waited = 0, 0.0
    while waited < retry_s and backoff_s(n + 1) < BACKOFF_MAX_S:
        n += 1
        waited += backoff_s(n)
    return n + max(0, math.ceil((retry_s - waited) / BACKOFF_MAX_S))


def check_data(data: DataConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    if data.workers < 0:
        fail("data.workers", f"must be >= 0, got {data.workers}")
    if data.shuffle_buffer < 0:
        fail("data.shuffle_buffer", f"must be >= 0 samples, got {data.shuffle_buffer}")
    if data.prefetch_factor < 1:
        fail("data.prefetch_factor", f"must be >= 1 batch per worker, got {data.prefetch_factor}")
    if data.max_image_pixels <= 0:
        fail("data.max_image_pixels", f"must be a positive number of pixels, got {data.max_image_pixels}")
    if not 0.0 <= data.max_corrupt_rate <= 1.0:
        fail("data.max_corrupt_rate", f"must be in [0, 1], got {data.max_corrupt_rate}")
    for key in ("remote_retry_s", "remote_timeout_s"):
        if not getattr(data, key) > 0:
            fail(f"data.{key}", f"must be > 0 seconds, got {getattr(data, key)}")
    need = outage_retries(data.remote_retry_s)
    if data.remote_retries is not None and data.remote_retries < need:
        waited = sum(backoff_s(n) for n in range(1, max(0, data.remote_retries) + 1))
        fail("data.remote_retries", f"{data.remote_retries} would end an outage after {waited:g} s, before "
             f"data.remote_retry_s={data.remote_retry_s:g} (the bound; this is only a guard): leave it out, "
             f"or at least {need}")
    if data.repeat_augment < 1:
        fail("data.repeat_augment", f"must be an integer >= 1 (1 = off; DeiT uses 3), got {data.repeat_augment!r}")
    if data.decode_device not in DEVICES:
        fail("data.decode_device", f"must be one of {', '.join(DEVICES)}, got {data.decode_device!r}")
    if data.worker_decoder not in WORKER_DECODERS:
        fail("data.worker_decoder", f"must be one of {', '.join(WORKER_DECODERS)}, got {data.worker_decoder!r}")
    a = data.augment
    if len(a.crop_scale) != 2 or not 0 < a.crop_scale[0] <= a.crop_scale[1] <= 1:
        fail("data.augment.crop_scale", f"must be [min, max] with 0 < min <= max <= 1, got {a.crop_scale}")
    if len(a.crop_ratio) != 2 or not 0 < a.crop_ratio[0] <= a.crop_ratio[1]:
        fail("data.augment.crop_ratio", f"must be [min, max] aspect ratios with 0 < min <= max, got {a.crop_ratio}")
    if not 0 <= a.hflip <= 1:
        fail("data.augment.hflip", f"must be a probability in [0, 1], got {a.hflip}")
    if a.randaugment_ops < 0:
        fail("data.augment.randaugment_ops", f"must be >= 0 (0: no RandAugment), got {a.randaugment_ops}")
    if not 0 <= a.randaugment_magnitude <= 30:
        fail("data.augment.randaugment_magnitude", f"must be in 0-30 (the 31 bins of torchvision's v2.RandAugment), "
             f"got {a.randaugment_magnitude}")
    for key in ("mixup_alpha", "cutmix_alpha"):
        if getattr(a, key) < 0:
            fail(f"data.augment.{key}", f"must be >= 0 (0: off), got {getattr(a, key)}")
    if not 0 < a.eval_crop_pct <= 1:
        fail("data.augment.eval_crop_pct", f"must be in (0, 1] (1: the whole image resized), got {a.eval_crop_pct}")
    if a.three_augment and a.randaugment_ops > 0:
        fail("data.augment.three_augment", f"replaces RandAugment (DeiT III): set data.augment.randaugment_ops=0, "
             f"got {a.randaugment_ops}")
    for key in ("mean", "std"):  # each named by itself: the two may come from different files
        if len(getattr(a, key)) != 3:
            fail(f"data.augment.{key}", f"needs 3 channels (R, G, B), got {getattr(a, key)}")
    if not all(s > 0 for s in a.std):
        fail("data.augment.std", f"must be > 0 in every channel, got {a.std}")
