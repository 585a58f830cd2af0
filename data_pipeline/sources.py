"""Readers for the writer's ``--source KIND:PATH``: imagefolder, cifar100, filelist, demo.

Each returns a :class:`Source`: class names in label order, and a list of small picklable items
(a path, raw pixels, or a demo recipe) whose ``load()`` gives encoded bytes or a PIL image, so the
writer can shuffle them and encode them in worker processes.

The official ``cifar-100-python`` files are pickles. They are read *only* from the path the user
gave, through :func:`safe_load_pickle`, whose unpickler can rebuild numpy arrays and nothing else.
"""
from __future__ import annotations

import io
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image

from data_pipeline.demo_data import demo_items
from data_pipeline.errors import DataError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")


# ----------------------------------------------------------------------------- safe unpickling
def _numpy_globals() -> dict:
    try:  # numpy >= 2 keeps the real module at numpy._core; numpy.core is a deprecated alias
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Every global a pickle names goes through ``find_class`` (REDUCE, NEWOBJ, INST, OBJ and the
    copyreg EXT opcodes alike), so allowing only numpy array reconstruction here means a pickle can
    build arrays, dicts, lists, numbers and strings, and can call nothing else."""

    _allowed = None

    def find_class(self, module: str, name: str):
        allowed = type(self)._allowed or _numpy_globals()
        type(self)._allowed = allowed
        try:
            return allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: only numpy arrays are allowed") from None


def safe_load_pickle(path_or_file: Union[str, os.PathLike, "io.BufferedIOBase"], encoding: str = "bytes"):
    """Load a pickle that may contain only plain containers, numbers, strings and numpy arrays
    (the CIFAR python format). ``encoding="bytes"`` reads Python-2 strings as bytes, as the
    official files need (their keys are ``b'data'``, ``b'fine_labels'``...). Raises
    ``pickle.UnpicklingError`` for anything else, before calling it."""
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, "rb") as f:
            return _NumpyOnlyUnpickler(f, encoding=encoding).load()
    return _NumpyOnlyUnpickler(path_or_file, encoding=encoding).load()


# ------------------------------------------------------------------------------------ sources
@dataclass(frozen=True)
class FileItem:
    path: str
    labels: tuple

    def load(self):
        with open(self.path, "rb") as f:
            return f.read()


@dataclass(frozen=True)
class PixelItem:
    pixels: bytes  # HWC uint8
    shape: tuple
    labels: tuple

    def load(self):
        return Image.fromarray(np.frombuffer(self.pixels, np.uint8).reshape(self.shape), "RGB")


@dataclass
class Source:
    description: str
    classes: list
    items: list
    multi_label: bool = False


def imagefolder(root: str) -> Source:
    """One sub-folder per class (the ImageNet / ImageNet-21k layout); classes sorted by name."""
    base = Path(root)
    if not base.is_dir():
        raise DataError(f"{root}: imagefolder source is not a directory")
    classes = sorted(d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{root}: no class sub-folders (expected ROOT/<class>/<image>)")
    items = []
    for label, name in enumerate(classes):
        for dirpath, dirnames, files in os.walk(base / name, followlinks=True):
            dirnames.sort()
            for f in sorted(files):
                if f.lower().endswith(IMG_EXTENSIONS):
                    items.append(FileItem(os.path.join(dirpath, f), (label,)))
    if not items:
        raise DataError(f"{root}: no images with extensions {', '.join(IMG_EXTENSIONS)}")
    return Source(f"imagefolder:{root}", classes, items)


def cifar100(path: str, split: str) -> Source:
    """The official ``cifar-100-python`` folder (or the folder holding it, or its ``.tar.gz``);
    fine labels."""
    if split not in ("train", "test"):
        raise DataError(f"--split {split}: cifar100 has splits train and test")
    data = _cifar_member(path, split)
    meta = _cifar_member(path, "meta")
    try:
        pixels = np.asarray(data[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        labels = list(data[b"fine_labels"])
        classes = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[b"fine_label_names"]]
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: not the cifar-100-python layout ({type(e).__name__}: {e})") from None
    if len(labels) != len(pixels):
        raise DataError(f"{path}: {split} has {len(pixels)} images but {len(labels)} fine_labels")
    items = [PixelItem(np.ascontiguousarray(p).tobytes(), (32, 32, 3), (int(y),)) for p, y in zip(pixels, labels)]
    return Source(f"cifar100:{path}", classes, items)


def _cifar_member(path: str, name: str):
    p = Path(path)
    try:
        if p.is_file() and tarfile.is_tarfile(p):
            with tarfile.open(p, "r:*") as tar:  # read in memory: nothing is extracted to disk
                member = next((m for m in tar.getmembers() if m.isreg() and Path(m.name).name == name), None)
                if member is None:
                    raise DataError(f"{path}: archive has no member named {name!r}")
                return safe_load_pickle(io.BytesIO(tar.extractfile(member).read()))
        for base in (p, p / "cifar-100-python"):
            if (base / name).is_file():
                return safe_load_pickle(base / name)
    except (pickle.UnpicklingError, EOFError, tarfile.TarError, ValueError) as e:
        raise DataError(f"{path}: cannot read CIFAR file {name!r}: {e}") from None
    raise DataError(f"{path}: no CIFAR file {name!r} (expected the cifar-100-python folder or its .tar.gz)")


def filelist(path: str) -> Source:
    """Lines ``path<TAB>label[,label...]``; paths relative to the list's folder; ``#`` comments.
    Labels are integers (classes "0".."max") or names (classes sorted); several labels make the
    data multi-label."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: file list not found")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 2 or not parts[0] or not parts[1].strip():
            raise DataError(f"{path}:{n}: expected 'path<TAB>label[,label...]', got {line!r}")
        labels = [t.strip() for t in parts[1].split(",") if t.strip()]
        rows.append((parts[0], labels))
    if not rows:
        raise DataError(f"{path}: no entries")
    tokens = {t for _, labs in rows for t in labs}
    if all(t.isdigit() for t in tokens):
        classes = [str(i) for i in range(max(int(t) for t in tokens) + 1)]
        to_label = int
    else:
        classes = sorted(tokens)
        to_label = {c: i for i, c in enumerate(classes)}.__getitem__
    items = []
    for file, labs in rows:
        full = file if os.path.isabs(file) else str(p.parent / file)
        items.append(FileItem(full, tuple(to_label(t) for t in labs)))
    multi = any(len(it.labels) > 1 for it in items)
    return Source(f"filelist:{path}", classes, items, multi_label=multi)


def demo_source(kind: str, split: str):
    """``--source demo --split train|val`` and ``--source demo-transfer --split train|test``."""
    name = split if kind == "demo" else f"transfer-{split}"
    valid = ("train", "val") if kind == "demo" else ("train", "test")
    if split not in valid:
        raise DataError(f"--split {split}: --source {kind} has splits {' and '.join(valid)}")
    classes, items = demo_items(name)
    return Source(kind, classes, items)


def open_source(spec: str, split: str) -> Source:
    """``KIND:PATH`` (or ``demo`` / ``demo-transfer``) -> Source."""
    kind, _, path = spec.partition(":")
    if kind in ("demo", "demo-transfer"):
        return demo_source(kind, split)
    if kind not in ("imagefolder", "cifar100", "filelist"):
        raise DataError(f"--source {spec}: unknown kind {kind!r}; use imagefolder:DIR, cifar100:PATH, "
                        "filelist:FILE, demo or demo-transfer")
    if not path:
        raise DataError(f"--source {spec}: missing path after '{kind}:'")
    if not os.path.exists(path):
        raise DataError(f"{path}: not found (--source {spec})")
    if kind == "imagefolder":
        return imagefolder(path)
    if kind == "cifar100":
        return cifar100(path, split)
    return filelist(path)
