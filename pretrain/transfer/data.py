"""Evaluation data as *splits*: anything that yields ``(images, labels)`` tensor batches.

Protocols see only :class:`Split`; where the images live is the split's business:

* :class:`ImageSet` (map-style) -- files on disk (VTAB-1k, ImageFolder), a uint8 pixel array
  (CIFAR-100) or demo recipes drawn on the fly; decoded lazily in DataLoader workers, so a
  20k-image VTAB test set never sits in memory at 224 px. :class:`Subset` selects indices
  (CIFAR's minival) and shares its parent's images and cached features.
* :class:`ShardSplit` -- our WebDataset shards + manifest.json, through ``data_pipeline.loading.loader``.

A :class:`View` says how images become tensors: resolution, resize mode, augmentation for
training batches, normalisation. ``train=True`` gives an endless shuffled (augmented) stream,
``train=False`` one pass (a shard split's batches in manifest order only with one reader per rank:
``indexed_batches`` gives every row's position, whatever the workers). With ``world > 1`` each
rank gets a disjoint share.

An unreadable image file is an error naming it (and the split-file line it came from), not a
skipped sample: a benchmark number computed over a test set with holes is not comparable.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from data_pipeline.loading.plan import TAG_SAMPLE, mix_seed
from data_pipeline.shards.decode import to_rgb
from pretrain.transfer.errors import TransferError

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class View:
    img_size: int
    # "squash": resize straight to img_size x img_size -- low-resolution data (CIFAR's 32 px) and
    # VTAB's structured tasks, whose labels (object location, distance) a crop would change.
    # "crop": shorter side to img_size / crop_pct, then a center crop (natural photos).
    resize: str = "squash"
    crop_pct: float = 0.875
    mean: tuple = (0.5, 0.5, 0.5)  # the ViT paper / big_vision map pixels to [-1, 1]
    std: tuple = (0.5, 0.5, 0.5)
    train_augment: bool = False  # random resized crop + flip on training batches
    crop_scale: tuple = (0.08, 1.0)
    crop_ratio: tuple = (0.75, 4 / 3)
    hflip: float = 0.5


def make_view(task, img_size: int, aug, train_augment: Optional[bool] = None) -> View:
    """How ``task``'s images become tensors for a model pre-trained with ``aug`` (the ``data.augment``
    section): the task's resize mode, ``aug``'s evaluation crop and normalisation, and, where
    ``train_augment`` (None: the task's own default) says so, ``aug``'s random resized crop and flip
    on training batches. The one rule of vit-transfer and the in-training probes."""
    augment = task.augment if train_augment is None else train_augment
    return View(img_size=img_size, resize=task.resize, crop_pct=aug.eval_crop_pct, mean=tuple(aug.mean),
                std=tuple(aug.std), train_augment=augment, crop_scale=tuple(aug.crop_scale),
                crop_ratio=tuple(aug.crop_ratio), hflip=aug.hflip)


def transfer_augment(aug, train_augment: bool):
    """``aug`` (a pre-training config's ``data.augment``) as a shard suite's transfer batches take it,
    the same augmentation every other suite's ``View`` gives: the random resized crop and flip
    (with ``train_augment``; else the whole image, unflipped: scale 1 at ratio 1 is a center
    crop). Pre-training's RandAugment, 3-Augment and batch mixing are left out (the fine-tune
    recipe mixes its own batches, ``eval.mixup_alpha`` / ``cutmix_alpha``), as is repeated
    augmentation, which the caller turns off."""
    aug = replace(aug, mixup_alpha=0.0, cutmix_alpha=0.0, randaugment_ops=0, three_augment=False)
    if not train_augment:
        aug = replace(aug, crop_scale=[1.0, 1.0], crop_ratio=[1.0, 1.0], hflip=0.0)
    return aug


def normalize(batch_u8: torch.Tensor, view: View) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 normalised, once per batch rather than per image."""
    m = torch.tensor(view.mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    s = torch.tensor(view.std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    return batch_u8.float().sub_(m).div_(s)


class SampleTransform:
    """PIL image -> uint8 (3, S, S) tensor; picklable for DataLoader workers. A training crop and
    flip are drawn from the sample's ``seed`` on a forked RNG (as pre-training's transforms do): the
    same on any rank layout or worker count, whatever torch's global RNG holds, and independent
    between samples, so the ranks of a fine-tune (which seed that RNG alike) do not draw in lockstep."""

    def __init__(self, view: View, train: bool):
        self.view, self.train = view, train and view.train_augment
        if self.train:
            self.aug = v2.Compose([
                v2.RandomResizedCrop(view.img_size, scale=view.crop_scale, ratio=view.crop_ratio, antialias=True),
                v2.RandomHorizontalFlip(view.hflip)])

    def __call__(self, img: Image.Image, seed: int = 0) -> torch.Tensor:
        t = TF.pil_to_tensor(img.convert("RGB"))
        s = self.view.img_size
        if self.train:
            with torch.random.fork_rng(devices=[]):
                torch.random.default_generator.manual_seed(seed)
                return self.aug(t)
        if self.view.resize == "squash":
            return TF.resize(t, [s, s], antialias=True)
        t = TF.resize(t, int(round(s / self.view.crop_pct)), antialias=True)
        return TF.center_crop(t, [s, s])


# ------------------------------------------------------------------------------------- splits
class Split(abc.ABC):
    """A named set of labelled images that can be iterated as tensor batches."""

    name: str

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def batches(self, view: View, *, batch_size: int, train: bool, seed: int = 0, rank: int = 0,
                world: int = 1, workers: int = 0, device=None) -> Iterator[Batch]:
        """Normalised (x, y) batches of ``view``. ``device``: where the consumer computes; shard
        batches are finished there (the training loader's finisher), others arrive on the CPU, in
        pinned memory when ``device`` is a GPU."""

    def indexed_batches(self, view: View, *, batch_size: int, workers: int = 0,
                        device=None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One evaluation pass in this process as ``(x, y, rows)``: ``rows`` (int64, on the CPU) is
        each image's position in the split, so a consumer can keep rows in split order whatever
        order the batches come in (a shard split's depends on ``workers``). Here the batches come
        in split order and rows are counted."""
        at = 0
        for x, y in self.batches(view, batch_size=batch_size, train=False, workers=workers, device=device):
            yield x, y, torch.arange(at, at + len(y))
            at += len(y)


class _Mapped(Dataset):
    """``images[indices]`` through ``transform``; ``stream`` (run seed, epoch) seeds each sample's draws."""

    def __init__(self, images: "ImageSet", indices: np.ndarray, transform: SampleTransform, stream: tuple = (0, 0)):
        self.images, self.indices, self.transform, self.stream = images, indices, transform, stream

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        j = int(self.indices[i])
        label = int(self.images.labels[j])
        try:
            return self.transform(self.images.image(j), mix_seed(TAG_SAMPLE, *self.stream, j)), label, ""
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            # Raised inside a worker, an exception reaches the main process wrapped in a
            # multi-line traceback; hand back the one-line reason instead (see _collate).
            s = self.transform.view.img_size
            return torch.zeros(3, s, s, dtype=torch.uint8), label, f"{self.images.describe(j)}: {e}"


def _collate(samples):
    errors = [e for _, _, e in samples if e]
    if errors:
        return None, None, errors[0]
    return torch.stack([x for x, _, _ in samples]), torch.tensor([y for _, y, _ in samples]), ""


class ImageSet(Split):
    """Map-style images with integer ``labels`` (np.int64); subclasses implement ``image(i)``."""

    def __init__(self, name: str, labels: Sequence[int]):
        self.name = name
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    @abc.abstractmethod
    def image(self, i: int) -> Image.Image: ...

    def describe(self, i: int) -> str:
        return f"{self.name}[{i}]"

    def batches(self, view, *, batch_size, train, seed=0, rank=0, world=1, workers=0, device=None):
        return _iterate(self, np.arange(len(self)), view, batch_size=batch_size, train=train, seed=seed,
                        rank=rank, world=world, workers=workers, device=device)


def _iterate(images: ImageSet, indices: np.ndarray, view: View, *, batch_size: int, train: bool, seed: int,
             rank: int, world: int, workers: int, device=None) -> Iterator[Batch]:
    transform = SampleTransform(view, train)
    pin = device is not None and torch.device(device).type == "cuda"
    epoch = 0
    while True:
        if train:  # a new permutation per epoch; equal shares per rank (DDP needs equal counts)
            order = indices[np.random.default_rng([seed, epoch]).permutation(len(indices))]
            share = len(order) // world
            mine = order[rank * share:(rank + 1) * share]
        else:
            mine = indices[rank::world]
        if len(mine) == 0:
            if train:
                raise TransferError(f"{images.name}: {len(indices)} examples cannot feed {world} ranks")
            return
        loader = DataLoader(_Mapped(images, mine, transform, (seed, epoch)), batch_size=min(batch_size, len(mine)),
                            shuffle=False, drop_last=train, num_workers=workers, collate_fn=_collate, pin_memory=pin,
                            # the workers' base seed too from (seed, epoch), not the global RNG
                            generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        for x, y, err in loader:
            if err:
                raise TransferError(err)
            yield normalize(x, view), y
        if not train:
            return
        epoch += 1


class FileImages(ImageSet):
    """Image files (VTAB-1k, ImageFolder); ``where`` names the list each path came from."""

    def __init__(self, name: str, paths: Sequence[str], labels: Sequence[int], where: Sequence[str] = ()):
        super().__init__(name, labels)
        self.paths, self.where = list(paths), list(where)

    def image(self, i: int) -> Image.Image:
        with Image.open(self.paths[i]) as im:  # converted inside: closing the file frees the core
            return to_rgb(im)  # the pipeline's one 8-bit mapping: EXIF orientation, alpha, 16-bit

    def describe(self, i: int) -> str:
        return f"{self.where[i]}: {self.paths[i]}" if self.where else self.paths[i]


class ArrayImages(ImageSet):
    """A uint8 (N, H, W, 3) pixel array (CIFAR-100)."""

    def __init__(self, name: str, pixels: np.ndarray, labels: Sequence[int]):
        super().__init__(name, labels)
        self.pixels = pixels

    def image(self, i: int) -> Image.Image:
        return Image.fromarray(self.pixels[i], "RGB")


class RecipeImages(ImageSet):
    """Items with a ``load() -> PIL.Image`` (the built-in demo set draws its images on demand)."""

    def __init__(self, name: str, items: Sequence, labels: Sequence[int]):
        super().__init__(name, labels)
        self.items = list(items)

    def image(self, i: int) -> Image.Image:
        return self.items[i].load()


class Subset(ImageSet):
    """Rows ``indices`` of ``parent``; features of a subset are sliced from the parent's."""

    def __init__(self, name: str, parent: ImageSet, indices: Sequence[int]):
        self.parent, self.indices = parent, np.asarray(indices, dtype=np.int64)
        super().__init__(name, parent.labels[self.indices])

    def image(self, i: int) -> Image.Image:
        return self.parent.image(int(self.indices[i]))

    def describe(self, i: int) -> str:
        return self.parent.describe(int(self.indices[i]))

    def batches(self, view, *, batch_size, train, seed=0, rank=0, world=1, workers=0, device=None):
        return _iterate(self.parent, self.indices, view, batch_size=batch_size, train=train, seed=seed,
                        rank=rank, world=world, workers=workers, device=device)


class Concat(ImageSet):
    """``parts`` one after the other (VTAB's train800 + val200 = train800val200)."""

    def __init__(self, name: str, parts: Sequence[ImageSet]):
        self.parts = list(parts)
        super().__init__(name, np.concatenate([p.labels for p in self.parts]))
        self._starts = np.cumsum([0] + [len(p) for p in self.parts])

    def _locate(self, i: int) -> tuple[ImageSet, int]:
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.parts[k], i - int(self._starts[k])

    def image(self, i: int) -> Image.Image:
        part, j = self._locate(i)
        return part.image(j)

    def describe(self, i: int) -> str:
        part, j = self._locate(i)
        return part.describe(j)


def holdout(split: ImageSet, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(train, minival) cut from ``split``, as big_vision's ``train[:98%]`` / ``train[98%:]`` --
    but from a seeded permutation so a sorted-by-class file cannot leave classes out of one side.
    (Streamed shards have no addressable rows: their suite takes a val/ split instead.)"""
    n = len(split)
    n_val = max(1, int(round(fraction * n)))
    if n_val >= n:
        raise TransferError(f"{split.name}: {n} examples are too few to hold out a validation split")
    order = np.random.default_rng([seed, 7]).permutation(n)
    return (Subset(f"{split.name}[train]", split, np.sort(order[n_val:])),
            Subset(f"{split.name}[minival]", split, np.sort(order[:n_val])))


class ShardSplit(Split):
    """Our WebDataset shards (a manifest.json or its folder), via ``data_pipeline.loading.loader``.
    Images arrive decoded, resized (the loader's own eval crop / train augmentation) and
    normalised with ``data.augment.mean/std``."""

    def __init__(self, name: str, manifest, data_cfg):
        from data_pipeline.shards.manifest import resolve_shards
        from data_pipeline.storage.retry import RemotePolicy

        # one manifest (path or folder) or a list of them (train + val = trainval)
        self.name, self.spec = name, [str(m) for m in manifest] if isinstance(manifest, list) else str(manifest)
        self.data_cfg = data_cfg
        self.shardset = resolve_shards(self.spec, allow_remote=data_cfg.allow_remote, key=f"{name} shards",
                                       policy=RemotePolicy.of(data_cfg))
        if self.shardset.multi_label:
            raise TransferError(f"{manifest}: multi-label shards; transfer evaluation needs one label per image")

    def __len__(self) -> int:
        return self.shardset.total

    @property
    def num_classes(self) -> int:
        return self.shardset.num_classes

    def _loader(self, view, *, batch_size, train, seed=0, rank=0, world=1, workers=0, device=None):
        from data_pipeline.loading.loader import build_loader

        cfg = replace(self.data_cfg, train_shards=self.spec, val_shards=self.spec, workers=workers,
                      img_size=None, augment=transfer_augment(self.data_cfg.augment, view.train_augment),
                      repeat_augment=1)
        return build_loader(cfg, rank=rank, world_size=world, batch_size=batch_size, seed=seed,
                            img_size=view.img_size, train=train, device=device)

    def batches(self, view, *, batch_size, train, seed=0, rank=0, world=1, workers=0, device=None):
        """With ``train=False`` rank ``r``'s share is a run of the split in manifest order, and its
        batches come in that order with ``workers`` 0 or 1; with more, the workers' parts of the run
        interleave (``indexed_batches`` says where each row belongs)."""
        return iter(self._loader(view, batch_size=batch_size, train=train, seed=seed, rank=rank, world=world,
                                 workers=workers, device=device))

    def indexed_batches(self, view, *, batch_size, workers=0, device=None):
        """Rows are manifest positions, carried through the loader's workers (``last_positions``); a
        sample that failed to decode leaves its position out."""
        loader = self._loader(view, batch_size=batch_size, train=False, workers=workers, device=device)
        for x, y in loader:
            yield x, y, torch.tensor(loader.last_positions, dtype=torch.int64)
