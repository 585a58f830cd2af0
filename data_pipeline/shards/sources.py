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
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image

from data_pipeline.errors import DataError
from data_pipeline.shards.demo_data import demo_items

_INTEGER = re.compile(r"[+-]?[0-9]+")  # what a file list reads as a class id (signed: to refuse it)
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
    name: str = ""  # how a message names it: relative to the source's folder or list


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


def imagefolder(root: str, allow_empty_classes: bool = False) -> Source:
    """One sub-folder per class (the ImageNet / ImageNet-21k layout); classes sorted by name. A
    class folder without any image is an error (a typo'd or unsynced folder would otherwise become
    a class no sample ever has), unless ``allow_empty_classes`` keeps it as such a class."""
    base = Path(root)
    if not base.is_dir():
        raise DataError(f"{root}: imagefolder source is not a directory")
    classes = sorted(d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{root}: no class sub-folders (expected ROOT/<class>/<image>)")
    items, empty = [], []
    for label, name in enumerate(classes):
        before = len(items)
        for dirpath, dirnames, files in os.walk(base / name, followlinks=True):
            dirnames.sort()
            for f in sorted(files):
                if f.lower().endswith(IMG_EXTENSIONS):
                    path = os.path.join(dirpath, f)
                    items.append(FileItem(path, (label,), os.path.relpath(path, base)))
        if len(items) == before:
            empty.append(name)
    if not items:
        raise DataError(f"{root}: no images with extensions {', '.join(IMG_EXTENSIONS)}")
    if empty and not allow_empty_classes:
        more = f" (and {len(empty) - 1} more: {', '.join(empty[1:4])}{', ...' if len(empty) > 4 else ''})" \
            if len(empty) > 1 else ""
        raise DataError(f"{base / empty[0]}: class folder holds no images{more}; add images, remove the "
                        "folder, or pass --allow-empty-classes to keep it as a class without samples")
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
    Labels are either all non-negative integers (classes "0".."max") or all names (classes sorted);
    several labels make the data multi-label. A label that looks like an integer among names, a
    name among integers, or a negative integer is an error naming its line: silently switching to
    names would renumber every class."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: file list not found")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = p.read_bytes()[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x}); a file list is lines of "
                        "'path<TAB>label[,label...]'") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 2 or not parts[0] or not parts[1].strip():
            raise DataError(f"{path}:{n}: expected 'path<TAB>label[,label...]', got {line!r}")
        labels = [t.strip() for t in parts[1].split(",") if t.strip()]
        rows.append((n, parts[0], labels))
    if not rows:
        raise DataError(f"{path}: no entries")
    numeric = [(n, t) for n, _, labs in rows for t in labs if _INTEGER.fullmatch(t)]
    named = [(n, t) for n, _, labs in rows for t in labs if not _INTEGER.fullmatch(t)]
    signed = next(((n, t) for n, t in numeric if t[0] in "+-"), None)
    if signed and len(numeric) >= len(named):
        raise DataError(f"{path}:{signed[0]}: label {signed[1]!r}: class ids must be non-negative integers "
                        "written as plain digits (0, 1, 2, ...)")
    if numeric and named:  # the minority kind is the odd one out
        n, t = named[0] if len(numeric) >= len(named) else numeric[0]
        kind, other = ("a name", "integers") if len(numeric) >= len(named) else ("an integer", "names")
        raise DataError(f"{path}:{n}: label {t!r} is {kind} but the other labels are {other}; labels "
                        "must be all non-negative integers (class ids) or all class names")
    if numeric:
        classes = [str(i) for i in range(max(int(t) for _, t in numeric) + 1)]
        to_label = int
    else:
        classes = sorted({t for _, t in named})
        to_label = {c: i for i, c in enumerate(classes)}.__getitem__
    items = []
    for _, file, labs in rows:
        full = file if os.path.isabs(file) else str(p.parent / file)
        items.append(FileItem(full, tuple(to_label(t) for t in labs), file))
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


def open_source(spec: str, split: str, allow_empty_classes: bool = False) -> Source:
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
        return imagefolder(path, allow_empty_classes)
    if kind == "cifar100":
        return cifar100(path, split)
    return filelist(path)
