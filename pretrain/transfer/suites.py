"""Readers that turn a ``--data-root`` into :class:`Task` objects; nothing is ever downloaded.

Each task has four splits in the roles of the VTAB protocol: ``train`` -> ``val`` to select
hyper-parameters, ``trainval`` to retrain the chosen setting, ``test`` to report. Suites without
a validation split get a seeded minival cut from train (big_vision's ``train[:98%]``).

Layouts:
  cifar100     the official ``cifar-100-python`` folder (``train``, ``test``, ``meta``; fine
               labels), or the folder holding it. The files are the dataset authors' pickles:
               read only from the given path, through ``safe_load_pickle`` (numpy arrays,
               containers, numbers and strings; nothing can be called).
  vtab1k       ROOT/<task>/{train800,val200,train800val200,test}.txt, lines ``relative/path label``
               (the PyTorch VTAB-1k layout); task folders by paper or short name (``vtab.py``).
  imagefolder  ROOT/train/<class>/..., ROOT/test/<class>/..., optional ROOT/val/<class>/...;
               for ``--protocol head`` ROOT/<class>/... or ROOT/<image> alone (``labelled_folder``)
  shards       ROOT/{train,test}[/val] each holding WebDataset shards + manifest.json; ROOT may be
               s3://bucket/prefix (with data.allow_remote=true), whose val/ is found by asking the
               store for val/manifest.json; for ``--protocol head`` ROOT is one set of shards.
  demo         the built-in held-out demo shapes (``data_pipeline.shards.demo_data``): their shards
               under ROOT/transfer-{train,test} when --data-root is given, else drawn on demand.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from data_pipeline.shards.manifest import MANIFEST_NAME
from data_pipeline.storage.places import open_place
from data_pipeline.storage.retry import RemotePolicy
from data_pipeline.storage.urls import is_remote, is_s3, last_part
from pretrain.evaluation.config import SUITE_NEEDS_ROOT
from pretrain.transfer import vtab
from pretrain.transfer.data import (
    ArrayImages,
    Concat,
    FileImages,
    RecipeImages,
    ShardSplit,
    Split,
    holdout,
)
from pretrain.transfer.errors import TransferError


@dataclass
class Task:
    name: str
    num_classes: int
    train: Split
    val: Optional[Split]  # None: no validation split (a sweep then refuses to run)
    trainval: Split
    test: Split
    group: Optional[str] = None  # VTAB group
    resize: str = "squash"  # View.resize for this task's images
    augment: bool = True  # default of eval.train_augment for fine-tuning
    class_names: Optional[tuple[str, ...]] = None  # label i's name, where the set names its classes (--protocol head)


def _need_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise TransferError(f"{path}: {what} not found")
    return path


# ----------------------------------------------------------------------------------- CIFAR-100
def _cifar_file(root: Path, name: str):
    from data_pipeline.shards.sources import safe_load_pickle

    for base in (root, root / "cifar-100-python"):
        if (base / name).is_file():
            try:
                return safe_load_pickle(base / name)
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
                raise TransferError(f"{base / name}: not a CIFAR-100 pickle ({e})") from None
    raise TransferError(f"{root}: CIFAR-100 file {name!r} not found (expected the official "
                        "cifar-100-python folder with train, test and meta)")


def _cifar_split(root: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    d = _cifar_file(root, name)
    try:
        pixels = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        labels = np.asarray(d[b"fine_labels"], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise TransferError(f"{root}/{name}: not the cifar-100-python layout "
                            f"({type(e).__name__}: {e}; need b'data' and b'fine_labels')") from None
    if len(labels) != len(pixels):
        raise TransferError(f"{root}/{name}: {len(pixels)} images but {len(labels)} fine_labels")
    if len(labels) and (labels.min() < 0 or labels.max() >= 100):
        raise TransferError(f"{root}/{name}: fine labels outside 0..99")
    return np.ascontiguousarray(pixels), labels


def cifar100(root: str, minival_fraction: float, seed: int) -> Task:
    base = _need_dir(Path(root), "CIFAR-100 folder")
    meta = _cifar_file(base, "meta")
    if not isinstance(meta, dict) or len(meta.get(b"fine_label_names", ())) != 100:
        raise TransferError(f"{base}/meta: expected 100 fine_label_names")
    train = ArrayImages("cifar100/train", *_cifar_split(base, "train"))
    test = ArrayImages("cifar100/test", *_cifar_split(base, "test"))
    fit, val = holdout(train, minival_fraction, seed)
    return Task("cifar100", 100, fit, val, train, test, resize="squash", augment=True)


# ------------------------------------------------------------------------------------ VTAB-1k
def read_split_file(task_dir: Path, filename: str, num_classes: int, name: str) -> FileImages:
    """Lines ``relative/path label``; a missing file, malformed line, out-of-range label or
    missing image raises TransferError naming ``file:line``."""
    path = task_dir / filename
    if not path.is_file():
        raise TransferError(f"{path}: split file not found")
    paths, labels, where = [], [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(None, 1)  # the label is the last field; paths may hold spaces
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise TransferError(f"{path}:{n}: expected 'relative/path label', got {line.strip()!r}")
        label = int(parts[1])
        if not 0 <= label < num_classes:
            raise TransferError(f"{path}:{n}: label {label} outside 0..{num_classes - 1}")
        img = task_dir / parts[0].strip()
        if not img.is_file():
            raise TransferError(f"{path}:{n}: image {img} not found")
        paths.append(str(img))
        labels.append(label)
        where.append(f"{path}:{n}")
    if not paths:
        raise TransferError(f"{path}: no examples")
    return FileImages(name, paths, labels, where)


def vtab_task(task_dir: Path, task: str) -> Task:
    k = vtab.NUM_CLASSES[task]
    s = {role: read_split_file(task_dir, f, k, f"{task}/{f[:-4]}") for role, f in vtab.SPLIT_FILES.items()}
    tv = s["trainval"]
    # train800val200 is normally train800 + val200: reuse their features instead of recomputing
    if tv.paths == s["train"].paths + s["val"].paths and \
            tv.labels.tolist() == s["train"].labels.tolist() + s["val"].labels.tolist():
        tv = Concat(tv.name, [s["train"], s["val"]])
    # every task squashed to the square, no crop, no flip: the structured tasks' labels (location,
    # orientation, distance) would not survive them, and the other tasks take the same protocol
    return Task(task, k, s["train"], s["val"], tv, s["test"], group=vtab.GROUP_OF[task], resize="squash",
                augment=False)


def vtab1k(root: str, names: list[str]) -> tuple[list[Task], list[str]]:
    """The tasks present under ``root`` (or exactly ``names``), and the VTAB tasks missing.
    A task asked for by name but absent is an error; unasked ones are only listed as missing."""
    base = _need_dir(Path(root), "VTAB-1k folder")
    bad = [n for n in names if vtab.canonical(n) is None]
    if bad:
        raise TransferError(vtab.unknown_task(bad[0]))
    wanted = [vtab.canonical(n) for n in names] if names else list(vtab.TASKS)
    tasks, missing = [], []
    for t in wanted:
        d = next((base / f for f in vtab.folder_names(t) if (base / f).is_dir()), None)
        if d is None:
            if names:
                raise TransferError(f"{base}: VTAB-1k task {t!r} not found (looked for folder "
                                    f"{' or '.join(vtab.folder_names(t))})")
            missing.append(t)
            continue
        tasks.append(vtab_task(d, t))
    if not tasks:
        raise TransferError(f"{base}: no VTAB-1k task folders (expected e.g. {base}/caltech101/train800.txt)")
    missing += [t for t in vtab.TASKS if t not in wanted]
    return tasks, [t for t in vtab.TASKS if t in missing]


# -------------------------------------------------------------------------------- ImageFolder
def _folder(root: Path, classes: Optional[list[str]] = None) -> tuple[list[str], FileImages]:
    from data_pipeline.shards.sources import imagefolder as read_folder

    src = read_folder(str(root))
    if classes is None:
        classes = src.classes
    unknown = sorted(set(src.classes) - set(classes))
    if unknown:
        raise TransferError(f"{root}: class folder {unknown[0]!r} is not among the train classes")
    remap = [classes.index(c) for c in src.classes]
    return classes, FileImages(f"{root.parent.name}/{root.name}", [it.path for it in src.items],
                               [remap[it.labels[0]] for it in src.items])


def imagefolder_splits(root: str) -> tuple[list[str], FileImages, Optional[FileImages], FileImages]:
    """(classes, train, val or None, test) of ROOT/train, [ROOT/val,] ROOT/test: the folders as
    they are, with no validation split held out of train."""
    base = _need_dir(Path(root), "ImageFolder root")
    _need_dir(base / "train", "train/ folder (ImageFolder suite: ROOT/train/<class>/...)")
    _need_dir(base / "test", "test/ folder (ImageFolder suite: ROOT/test/<class>/...)")
    classes, train = _folder(base / "train")
    _, test = _folder(base / "test", classes)
    val = _folder(base / "val", classes)[1] if (base / "val").is_dir() else None
    return classes, train, val, test


def imagefolder(root: str, minival_fraction: float, seed: int) -> Task:
    classes, train, val, test = imagefolder_splits(root)
    name = Path(root).name
    if val is not None:
        fit, trainval = train, Concat(f"{name}/trainval", [train, val])
    else:
        (fit, val), trainval = holdout(train, minival_fraction, seed), train
    return Task(name, len(classes), fit, val, trainval, test, resize="crop", augment=True)


def labelled_folder(root: str) -> Task:
    """``--protocol head``: ROOT is the evaluated set itself. ROOT/<class>/... (sorted class names
    are the indices, as ImageNet's synset folders; folders all named by integers are the indices
    themselves, as ImageNet-V2's ``0``..``999``), or images directly in ROOT, unlabelled (ImageNet
    val as distributed, scored with ``eval.real_labels``)."""
    from data_pipeline.shards.sources import IMG_EXTENSIONS
    from data_pipeline.shards.sources import imagefolder as read_folder

    base = _need_dir(Path(root), "image folder")
    if any(d.is_dir() and not d.name.startswith(".") for d in base.iterdir()):
        src = read_folder(str(base))
        numbered = all(c.isdigit() for c in src.classes)
        index = [int(c) for c in src.classes] if numbered else list(range(len(src.classes)))
        paths, labels = [it.path for it in src.items], [index[it.labels[0]] for it in src.items]
        num_classes = max(index) + 1
        names = None if numbered else tuple(src.classes)
    else:
        paths = sorted(str(f) for f in base.iterdir() if f.is_file() and f.name.lower().endswith(IMG_EXTENSIONS))
        if not paths:
            raise TransferError(f"{base}: no images and no class folders")
        labels, num_classes, names = [-1] * len(paths), 0, None
    split = FileImages(base.name, paths, labels)
    return Task(base.name, num_classes, split, None, split, split, resize="crop", augment=False, class_names=names)


def labelled_shards(root: str, data_cfg) -> Task:
    """``--protocol head``: ROOT is one set of shards (a ``manifest.json`` or its folder)."""
    where = root.rstrip("/")
    if where.endswith(MANIFEST_NAME):
        where = where[:-len(MANIFEST_NAME)].rstrip("/")
    split = ShardSplit(last_part(where) or "shards", root, data_cfg)
    return Task(split.name, split.num_classes, split, None, split, split, resize="crop", augment=False,
                class_names=tuple(split.shardset.classes))


# ------------------------------------------------------------------------------------- shards
def _split_manifests(root: str, data_cfg) -> dict[str, tuple[str, bool]]:
    """``{split: (ROOT/split/manifest.json, whether it is there)}`` for train, test and val. ROOT is
    a folder or ``s3://bucket/prefix`` (the store is asked for each manifest by name); another URL
    is refused, as nothing could look for its splits."""
    if is_remote(root) and not is_s3(root):
        raise TransferError(f"{root}: the shards suite reads a folder or s3://bucket/prefix "
                            f"({root.split(':', 1)[0]}: URLs cannot be searched for train/ test/ val/)")
    if is_s3(root) and not data_cfg.allow_remote:
        raise TransferError(f"{root}: an s3:// shards root needs data.allow_remote=true (it reaches the network)")
    if not is_s3(root):
        _need_dir(Path(root), "shards root")
    out = {}
    for split in ("train", "test", "val"):
        folder = open_place(f"{root.rstrip('/')}/{split}" if is_s3(root) else Path(root) / split, "--data-root",
                            RemotePolicy.of(data_cfg))
        out[split] = (folder.url(MANIFEST_NAME), folder.stat(MANIFEST_NAME) is not None)
    return out


def shards(root: str, data_cfg) -> Task:
    manifests = _split_manifests(root, data_cfg)
    for split in ("train", "test"):
        if not manifests[split][1]:
            raise TransferError(f"{manifests[split][0]}: not found (shards suite: ROOT/train and ROOT/test, "
                                "each with shards + manifest.json)")
    (train_m, _), (test_m, _), (val_m, has_val) = (manifests[s] for s in ("train", "test", "val"))
    name = last_part(root)
    train = ShardSplit(f"{name}/train", train_m, data_cfg)
    test = ShardSplit(f"{name}/test", test_m, data_cfg)
    if labels := test.shardset.labels_problem(train.shardset, key="--suite shards"):
        raise TransferError(labels)
    val, trainval = None, train  # a slice of a stream is not addressable: only a val/ split
    if has_val:
        val = ShardSplit(f"{name}/val", val_m, data_cfg)
        trainval = ShardSplit(f"{name}/trainval", [train_m, val_m], data_cfg)
    return Task(name, train.num_classes, train, val, trainval, test, resize="crop", augment=True)


# --------------------------------------------------------------------------------------- demo
def demo(minival_fraction: float, seed: int, root: Optional[str] = None, data_cfg=None,
         n_train: Optional[int] = None, n_test: Optional[int] = None) -> Task:
    """The 6 held-out demo shapes (never seen in demo pre-training). With ``root``: the shards
    ``vit-shards --source demo-transfer`` wrote to ROOT/transfer-train and ROOT/transfer-test
    (what ``make demo`` does); without: the same 1200 + 600 images drawn on the fly."""
    if root is not None:
        base = Path(root)
        manifests = [base / s / "manifest.json" for s in ("transfer-train", "transfer-test")]
        missing = [m for m in manifests if not m.is_file()]
        if missing:
            # said alike for vit-transfer's --data-root and a probe's demo:PATH (validation.fewshot_suites)
            raise TransferError(f"{missing[0]}: not found (the demo suite given a folder reads the transfer-train/ "
                                "and transfer-test/ shards `vit-shards --source demo-transfer` writes there; given "
                                "none, it draws the demo images on the fly)")
        train = ShardSplit("demo/transfer-train", manifests[0], data_cfg)
        test = ShardSplit("demo/transfer-test", manifests[1], data_cfg)
        return Task("demo", train.num_classes, train, None, train, test, resize="crop", augment=True)
    from data_pipeline.shards.demo_data import demo_items

    classes, tr = demo_items("transfer-train", n_train)
    _, te = demo_items("transfer-test", n_test)
    train = RecipeImages("demo/train", tr, [it.labels[0] for it in tr])
    test = RecipeImages("demo/test", te, [it.labels[0] for it in te])
    fit, val = holdout(train, minival_fraction, seed)
    return Task("demo", len(classes), fit, val, train, test, resize="crop", augment=True)


# ----------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Suite:
    """How ``eval.suite=NAME`` builds its tasks from the ``eval`` section and ``data`` section."""
    build: Callable  # (ev, data_cfg) -> (tasks, missing VTAB task names)
    needs_root: bool = True
    help: str = ""


# The builders of the suites the schema names (pretrain.evaluation.config.SUITE_NEEDS_ROOT: names and
# whether each needs a folder): vit-transfer's --suite choices and build_tasks read this table.
SUITES: dict[str, Suite] = {
    "cifar100": Suite(lambda ev, d: ([cifar100(ev.data_root, ev.minival_fraction, ev.seed)], []),
                      help="the official CIFAR-100 python pickles"),
    "vtab1k": Suite(lambda ev, d: vtab1k(ev.data_root, list(ev.tasks)), help="VTAB-1k task folders"),
    "demo": Suite(lambda ev, d: ([demo(ev.minival_fraction, ev.seed, ev.data_root, d)], []), needs_root=False,
                  help="the held-out demo shapes (drawn, or shards under --data-root)"),
    "imagefolder": Suite(lambda ev, d: ([imagefolder(ev.data_root, ev.minival_fraction, ev.seed)], []),
                         help="train/ [val/] test/, each of CLASS/IMAGE folders (head: CLASS/IMAGE)"),
    "shards": Suite(lambda ev, d: ([shards(ev.data_root, d)], []), help="our shards: train/ [val/] test/"),
}
assert {n: s.needs_root for n, s in SUITES.items()} == SUITE_NEEDS_ROOT, "suites and schema disagree"


# ``--protocol head`` trains nothing: for these suites --data-root is the evaluated set alone
# (other suites are scored on their test split)
EVAL_SETS: dict[str, Callable] = {"imagefolder": lambda ev, d: labelled_folder(ev.data_root),
                                  "shards": lambda ev, d: labelled_shards(ev.data_root, d)}


def build_tasks(ev, data_cfg) -> tuple[list[Task], list[str]]:
    """(tasks, missing VTAB tasks) for the ``eval`` section ``ev``."""
    suite = SUITES[ev.suite]
    if suite.needs_root and not ev.data_root:
        raise TransferError(f"--suite {ev.suite} needs --data-root (eval.data_root)")
    if getattr(ev, "protocol", None) == "head" and ev.suite in EVAL_SETS:
        return [EVAL_SETS[ev.suite](ev, data_cfg)], []
    return suite.build(ev, data_cfg)
