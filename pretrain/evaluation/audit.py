"""``vit-audit``: find evaluation images that also appear in the pre-training shards.

    vit-audit --index /shards/in21k/manifest.json --workers 8      # once: hashes.npz beside it
    vit-audit --shards /shards/in21k/manifest.json --eval cifar100:/data/cifar-100-python \\
              --eval vtab1k:/data/vtab-1k --output audit/

The method (hashes, candidates, confirmation, calibration) is ``data_pipeline/audit/``; this
module reads the evaluation sets through the transfer suites' own readers, so the audit sees
exactly the images, splits and labels vit-transfer evaluates on. IDs: ``split/index`` for
CIFAR-100, the file path relative to the set's root for folder sets, the sample key for shards.
``python -m pretrain.evaluation.audit`` is the same program.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator, Optional

from data_pipeline.audit.index import HASHES_NAME, MAX_BITS, MIN_SCORE, train_index
from data_pipeline.audit.match import EvalImage, audit, read_shards_eval, write_report
from data_pipeline.errors import DataError, Parser, cli_errors
from pretrain.transfer import suites
from pretrain.transfer.data import Concat, FileImages, ImageSet


# ----------------------------------------------------------------------- evaluation readers
def _image_set(set_name: str, split: str, images: ImageSet, ids) -> Iterator[EvalImage]:
    for i, image_id in enumerate(ids):
        yield EvalImage(set_name, split, image_id, lambda images=images, i=i: images.image(i))


def _files(images: ImageSet) -> list:
    """(FileImages, row) for every image of a FileImages or a Concat of them."""
    if isinstance(images, Concat):
        return [fr for part in images.parts for fr in _files(part)]
    assert isinstance(images, FileImages), type(images)
    return [(images, i) for i in range(len(images))]


def cifar100(path: str) -> Iterator[EvalImage]:
    """The official cifar-100-python folder: splits train and test, IDs ``train/123``."""
    task = suites.cifar100(path, minival_fraction=0.02, seed=0)
    for split, images in (("train", task.trainval), ("test", task.test)):
        yield from _image_set("cifar100", split, images, (f"{split}/{i}" for i in range(len(images))))


def vtab1k(path: str) -> Iterator[EvalImage]:
    """Every VTAB-1k task folder present: set ``vtab1k/<task>``, splits train800 / val200 / test
    (and train800val200 rows that are in neither train800 nor val200), IDs relative to PATH."""
    root = Path(path)
    tasks, _missing = suites.vtab1k(path, [])
    for task in tasks:
        seen = set()
        for split, images in (("train800", task.train), ("val200", task.val), ("test", task.test),
                              ("train800val200", task.trainval)):
            for files, i in _files(images):
                rel = os.path.relpath(files.paths[i], root)
                if rel in seen:
                    continue
                seen.add(rel)
                yield EvalImage(f"vtab1k/{task.name}", split, rel, lambda f=files, i=i: f.image(i))


def imagefolder(path: str) -> Iterator[EvalImage]:
    """ROOT/train, ROOT/test [ROOT/val] class folders: set ``imagefolder/<ROOT name>``, the split
    is the first folder of the ID (the path relative to ROOT)."""
    root = Path(path)
    task = suites.imagefolder(path, minival_fraction=0.02, seed=0)
    for images in (task.trainval, task.test):
        for files, i in _files(images):
            rel = os.path.relpath(files.paths[i], root)
            yield EvalImage(f"imagefolder/{root.name}", Path(rel).parts[0], rel, lambda f=files, i=i: f.image(i))


# every --eval SUITE:PATH this command reads
READERS = {"shards": read_shards_eval, "cifar100": cifar100, "vtab1k": vtab1k, "imagefolder": imagefolder}


# -------------------------------------------------------------------------------------- CLI
BUILTIN_READERS = {"shards": read_shards_eval}


READER_GROUP = "vitscale.audit_readers"


def eval_readers() -> dict:
    """Reader per suite name: ``shards`` from here, the others from installed entry points."""
    from importlib.metadata import entry_points

    readers = dict(BUILTIN_READERS)
    for ep in entry_points(group=READER_GROUP):
        readers.setdefault(ep.name, ep)
    return readers


def read_eval(spec: str, readers: Optional[dict] = None) -> Iterator[EvalImage]:
    """``SUITE:PATH`` -> its images. Unknown suite or missing path: one-line DataError."""
    readers = READERS if readers is None else readers
    kind, sep, path = spec.partition(":")
    if not sep or not path:
        raise DataError(f"--eval {spec}: expected SUITE:PATH with SUITE one of {', '.join(sorted(readers))}")
    if kind not in readers:
        raise DataError(f"--eval {spec}: unknown suite {kind!r}; known: {', '.join(sorted(readers))}")
    if not os.path.exists(path):
        raise DataError(f"{path}: not found (--eval {spec})")
    return readers[kind](path)


def check_output_dir(output) -> None:
    """DataError (one line) when ``write_report`` could not write into ``output``: a file there or
    on its path, or no file can be created in it (or in its nearest existing parent)."""
    from data_pipeline.files import unwritable

    why = unwritable(output)
    if why:
        raise DataError(f"--output {output}: {why}; choose a writable --output folder")


def main(argv=None) -> int:
    p = Parser(prog="vit-audit", description="Find evaluation images that also appear in pre-training shards.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--shards", nargs="+", metavar="MANIFEST", help="pre-training shard sets to audit")
    mode.add_argument("--index", nargs="+", metavar="MANIFEST",
                      help="only hash these shard sets (hashes.npz beside each manifest)")
    p.add_argument("--eval", action="append", default=[], metavar="SUITE:PATH",
                   help="evaluation set: cifar100:DIR, vtab1k:DIR, imagefolder:DIR, shards:MANIFEST_OR_ROOT")
    p.add_argument("--output", help="folder for audit.json, exclude.txt, closest_pairs.png")
    p.add_argument("--workers", type=int, default=1, help="processes hashing shards (default 1)")
    p.add_argument("--force", action="store_true", help="rebuild stored hashes even when they are current")
    p.add_argument("--max-bits", type=int, default=MAX_BITS,
                   help=f"candidate pHash distance (default {MAX_BITS}; lower: fewer candidates to confirm)")
    p.add_argument("--min-score", type=float, default=MIN_SCORE, help=f"confirmation score (default {MIN_SCORE})")
    p.add_argument("--grid", type=int, default=24, help="pairs drawn in closest_pairs.png (default 24)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.shards and (not args.eval or not args.output):
        p.error("--shards needs --eval SUITE:PATH (one or more) and --output DIR")

    with cli_errors("vit-audit"):
        if args.output:
            check_output_dir(args.output)  # before the hashing: a mistake costs a second, not the audit
        for m in args.index or []:
            idx = train_index(m, args.workers, rebuild=args.force, progress=not args.quiet)
            print(f"{len(idx.keys)} images hashed ({idx.unreadable} unreadable) -> "
                  f"{Path(idx.manifest).parent / HASHES_NAME}")
        if args.index:
            return 0
        indexes = [train_index(m, args.workers, rebuild=args.force, progress=not args.quiet) for m in args.shards]
        readers = READERS
        loaders: dict = {}
        evals_meta = []

        def all_evals():
            for spec in args.eval:
                n = 0
                for e in read_eval(spec, readers):
                    loaders[(e.set, e.split, e.id)] = e.load
                    n += 1
                    yield e
                evals_meta.append({"spec": spec, "images": n})

        result = audit(indexes, all_evals(), max_bits=args.max_bits, min_score=args.min_score)
        shown = {k: loaders[k]() for k in [(q.eval, q.split, q.eval_id) for q in result.pairs[:args.grid]]}
        doc = write_report(result, args.output, evals_meta, grid=args.grid, images=shown)
    _print_counts(doc, args.output)
    return 0


def _print_counts(doc: dict, out: str) -> None:
    print(f"{'set':28s} {'split':16s} {'images':>8s} {'contaminated':>13s} {'exact':>6s} {'near':>6s}")
    for s, splits in doc["counts"].items():
        for split, c in splits.items():
            print(f"{s:28s} {split:16s} {c['images']:8d} {c['contaminated']:13d} {c['exact_pairs']:6d} "
                  f"{c['near_pairs']:6d}")
    print(f"{len(doc['pairs'])} pairs ({doc['candidates']} candidates checked) -> {Path(out) / 'audit.json'}, "
          f"{Path(out) / 'exclude.txt'}, {Path(out) / 'closest_pairs.png'}")


if __name__ == "__main__":
    sys.exit(main())
