"""vit-analyze's images: a folder of images (any depth, classes interleaved) or our shards, prepared
as for evaluation, in batches with a name per image; files that are not images or do not decode are
skipped and counted, as vit-shards does."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import torch

from data_pipeline.errors import ConfigError
from data_pipeline.shards.sources import IMG_EXTENSIONS
from data_pipeline.shards.writer import skipped_summary

PROG = "vit-analyze"  # the command whose stderr lines these are
SKIPPED_SHOWN = 5  # skipped file names printed in the one stderr line (analysis.json keeps 1,000)


def _image_files(root: Path) -> tuple[list[str], list[str]]:
    """(image files, other files) below ``root`` (hidden files and folders left out). Images are
    ordered round-robin over their folders -- the first of every folder (class), then the second
    of each, ... -- so the first few images drawn come from several classes, not all from the
    first folder in sorted order. Deterministic: folders and files in sorted order."""
    by_folder: dict[str, list[str]] = {}
    others = []
    for dirpath, dirnames, names in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(dirpath, f)
            if f.lower().endswith(IMG_EXTENSIONS):
                by_folder.setdefault(dirpath, []).append(path)
            else:
                others.append(path)
    folders = list(by_folder.values())
    files = [f[i] for i in range(max(map(len, folders), default=0)) for f in folders if i < len(f)]
    return files, others


def _is_image_folder(spec: str) -> bool:
    from data_pipeline.shards.manifest import MANIFEST_NAME

    p = Path(spec)
    return p.is_dir() and not (p / MANIFEST_NAME).is_file()


class ImageSource:
    """Normalised (B, 3, S, S) float32 batches of at most ``limit`` images, each with a name, from
    a folder of images (any depth, classes interleaved: :func:`_image_files`) or shards (manifest
    order), prepared as for evaluation. As vit-shards does, files that are not images (by
    extension) and images that do not decode are skipped and counted in ``skipped`` (reason ->
    count; ``skipped_files`` names them) rather than failing the analysis. ``device``: where the
    consumer computes (shard batches are finished there, as in training).

        src = ImageSource(spec, img_size=224, augment=cfg.data.augment, limit=128)
        for x, names in src: ...
    """

    def __init__(self, spec: str, *, img_size: int, augment, limit: int, batch_size: int = 32, device=None):
        self.spec, self.img_size, self.augment, self.limit, self.batch_size = spec, img_size, augment, limit, batch_size
        self.skipped: dict[str, int] = {}
        self.skipped_files: list[str] = []
        if _is_image_folder(spec):
            self.files, others = _image_files(Path(spec))
            for path in others:
                self._skip("not_image", path)
            if not self.files:
                raise ConfigError(f"--images {spec}: no image files in this folder or below "
                                  f"({', '.join(IMG_EXTENSIONS)})"
                                  + (f"; {len(others)} other files skipped" if others else ""))
            self.total: Optional[int] = min(limit, len(self.files))
        else:
            if not Path(spec).exists() and "{" not in spec and "://" not in spec:
                raise ConfigError(f"--images {spec}: no such folder or manifest")
            from data_pipeline.config import DataConfig
            from data_pipeline.loading.loader import build_loader

            self.files = None
            self.loader = build_loader(DataConfig(val_shards=spec, workers=0, augment=augment),
                                       batch_size=batch_size, img_size=img_size, train=False, device=device)
            self.total = min(limit, self.loader.plan.shardset.total)

    def _skip(self, reason: str, path: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.skipped_files) < 1000:
            self.skipped_files.append(os.path.relpath(path, self.spec))

    def _counts(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))

    def skipped_line(self) -> str:
        """One line naming the skipped files ('' if none), as vit-shards prints it."""
        if not self.skipped:
            return ""
        return f"{PROG}: --images {self.spec}: {skipped_summary(self.skipped, self.skipped_files, SKIPPED_SHOWN)}"

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        batches = self._folder() if self.files is not None else self._shards()
        seen = 0
        for x, names in batches:
            x, names = x[:self.limit - seen], names[:self.limit - seen]
            seen += x.shape[0]
            yield x, names
            if seen >= self.limit:
                return
        if seen == 0:
            raise ConfigError(f"--images {self.spec}: no readable images"
                              + (f" (skipped {self._counts()})" if self.skipped else ""))

    def _folder(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        # one process, file by file: a file that does not decode is skipped here, where the
        # transfer splits' DataLoader (whose benchmark numbers must not have holes) would stop
        from pretrain.transfer.data import FileImages, SampleTransform, View, normalize

        view = View(self.img_size, resize="crop", crop_pct=self.augment.eval_crop_pct,
                    mean=tuple(self.augment.mean), std=tuple(self.augment.std))
        transform = SampleTransform(view, train=False)
        images = FileImages(f"--images {self.spec}", self.files, [0] * len(self.files))
        xs, names, taken = [], [], 0
        for i, path in enumerate(self.files):
            if taken >= self.limit:
                break
            try:
                xs.append(transform(images.image(i)))
            except Exception:  # any decode failure of a user's file: skipped and counted (vit-shards' rule)
                self._skip("unreadable", path)
                continue
            names.append(os.path.relpath(path, self.spec))
            taken += 1
            if len(xs) == self.batch_size:
                yield normalize(torch.stack(xs), view), names
                xs, names = [], []
        if xs:
            yield normalize(torch.stack(xs), view), names

    def _shards(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        for x, y in self.loader:
            classes = [f" (class {int(c)})" for c in y] if y.ndim == 1 else [""] * len(y)
            yield x, [f"{k}{c}" for k, c in zip(self.loader.last_keys, classes)]
