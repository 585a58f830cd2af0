"""``vit-audit``: find evaluation images that also appear in the pre-training shards.

    vit-audit --index /shards/in21k/manifest.json --workers 8      # once: hashes.npz beside it
    vit-audit --shards /shards/in21k/manifest.json --eval cifar100:/data/cifar-100-python \\
              --eval vtab1k:/data/vtab-1k --output audit/
    vit-audit --shards s3://bucket/in21k/train --eval shards:s3://bucket/c100 --output audit/

The method (hashes, candidates, confirmation, calibration) is ``data_pipeline/audit/``; this
module reads the evaluation sets through the transfer suites' own readers, so the audit sees
exactly the images, splits and labels vit-transfer evaluates on. IDs: ``split/index`` for
CIFAR-100, the file path relative to the set's root for folder sets, the sample key for shards.
Shards (``--shards``, ``--index``, ``--eval shards:``) may be ``s3://`` URLs: vit-audit has no
``data.allow_remote``, so naming one on the command line is the consent to reach the store; other
URLs (``pipe:``, ``http(s)://``) are refused. ``python -m pretrain.evaluation.audit`` is the same
program.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

from data_pipeline.audit.index import HASHES_NAME, MAX_BITS, MIN_SCORE, train_index
from data_pipeline.audit.match import EvalImage, audit, check_thresholds, read_shards_eval, write_report
from data_pipeline.errors import DataError, Parser, cli_errors, path_arg
from data_pipeline.files import check_output_dir
from data_pipeline.storage.urls import is_remote, is_s3
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
    _classes, train, val, test = suites.imagefolder_splits(path)
    for images in (s for s in (train, val, test) if s is not None):
        for files, i in _files(images):
            rel = os.path.relpath(files.paths[i], root)
            yield EvalImage(f"imagefolder/{root.name}", Path(rel).parts[0], rel, lambda f=files, i=i: f.image(i))


def shards(path: str) -> Iterator[EvalImage]:
    """Our shards (``read_shards_eval``): a manifest, its folder or the shards suite's ROOT, on disk
    or as an ``s3://`` URL (given on the command line: the user's consent to reach the store)."""
    return read_shards_eval(path, allow_remote=is_s3(path))


# every --eval SUITE:PATH this command reads
READERS = {"shards": shards, "cifar100": cifar100, "vtab1k": vtab1k, "imagefolder": imagefolder}


# -------------------------------------------------------------------------------------- CLI
def check_eval(spec: str) -> tuple[str, str]:
    """``SUITE:PATH`` -> (suite, path), checked without reading the set: an unknown suite, a missing
    path or a URL the suite cannot read is a one-line DataError. ``main`` runs it on every
    ``--eval`` before the training shards are hashed (hours on a large set)."""
    kind, sep, path = spec.partition(":")
    if not sep or not path:
        raise DataError(f"--eval {spec}: expected SUITE:PATH with SUITE one of {', '.join(sorted(READERS))}")
    if kind not in READERS:
        raise DataError(f"--eval {spec}: unknown suite {kind!r}; known: {', '.join(sorted(READERS))}")
    if is_remote(path) and kind != "shards":
        raise DataError(f"--eval {spec}: {kind} reads a local folder; only shards: sets may be s3:// URLs")
    if is_remote(path) and not is_s3(path):
        raise DataError(f"--eval {spec}: give a path or s3://bucket/prefix ({path.split(':', 1)[0]}: URLs "
                        "are not read by vit-audit)")
    if not is_remote(path) and not os.path.exists(path):
        raise DataError(f"{path}: not found (--eval {spec})")
    return kind, path


def read_eval(spec: str) -> Iterator[EvalImage]:
    """``SUITE:PATH`` -> its images, after ``check_eval``."""
    kind, path = check_eval(spec)
    return READERS[kind](path)


def shard_set(spec: str, option: str) -> str:
    """A ``--shards`` / ``--index`` argument, checked: a path that exists, or an ``s3://`` URL (named
    on the command line: the user's consent to reach the store); else a one-line DataError naming it."""
    if is_remote(spec) and not is_s3(spec):
        raise DataError(f"{option} {spec}: give a manifest.json, its folder or s3://bucket/prefix "
                        f"({spec.split(':', 1)[0]}: URLs are not read by vit-audit)")
    if not is_remote(spec) and not os.path.exists(spec):
        raise DataError(f"{option} {spec}: not found; give a manifest.json, its folder or s3://bucket/prefix")
    return spec


def main(argv=None) -> int:
    p = Parser(prog="vit-audit", description="Find evaluation images that also appear in pre-training shards.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--shards", nargs="+", metavar="MANIFEST", type=path_arg,
                      help="pre-training shard sets to audit: manifest.json, its folder or s3://bucket/prefix "
                           "(naming an s3:// URL is the consent to reach the store)")
    mode.add_argument("--index", nargs="+", metavar="MANIFEST", type=path_arg,
                      help="only hash these shard sets (hashes.npz beside each manifest, in its folder or prefix)")
    p.add_argument("--eval", action="append", default=[], metavar="SUITE:PATH",
                   help="evaluation set: cifar100:DIR, vtab1k:DIR, imagefolder:DIR, shards:MANIFEST_OR_ROOT "
                        "(a path or s3:// URL)")
    p.add_argument("--output", type=path_arg, help="folder for audit.json, exclude.txt, closest_pairs.png")
    p.add_argument("--workers", type=int, default=1, help="processes hashing shards (default 1)")
    p.add_argument("--force", action="store_true", help="rebuild stored hashes even when they are current")
    p.add_argument("--max-bits", type=int, default=MAX_BITS,
                   help=f"candidate pHash distance (default {MAX_BITS}; lower: fewer candidates to confirm)")
    p.add_argument("--min-score", type=float, default=MIN_SCORE, help=f"confirmation score (default {MIN_SCORE})")
    p.add_argument("--grid", type=int, default=24, help="pairs drawn in closest_pairs.png (default 24; 0: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.shards and (not args.eval or not args.output):
        p.error("--shards needs --eval SUITE:PATH (one or more) and --output DIR")
    if args.workers < 1:  # 0 or a negative count hashed in this one process as if 1 were given
        p.error(f"--workers {args.workers}: must be >= 1")
    if args.grid < 0:  # a negative slice drew every pair but the last ones
        p.error(f"--grid {args.grid}: must be >= 0 (0: no pairs drawn)")

    with cli_errors("vit-audit"):
        check_thresholds(args.max_bits, args.min_score)
        if args.output:
            check_output_dir(args.output)  # before the hashing: a mistake costs a second, not the audit
        option = "--index" if args.index else "--shards"
        specs = [shard_set(m, option) for m in args.index or args.shards]
        for spec in args.eval:
            check_eval(spec)  # before the hashing, as the output
        indexes = []
        for m in specs:
            idx = train_index(m, args.workers, rebuild=args.force, progress=not args.quiet, allow_remote=is_s3(m),
                              option=option)
            if args.index:
                print(f"{idx.coverage('hashed')} -> {idx.stored or f'{HASHES_NAME} not stored (see the note above)'}")
            indexes.append(idx)
        if args.index:
            return 0
        loaders: dict = {}
        evals_meta = []

        def all_evals():
            for spec in args.eval:
                n = 0
                for e in read_eval(spec):
                    loaders[(e.set, e.split, e.id)] = e.load
                    n += 1
                    yield e
                evals_meta.append({"spec": spec, "images": n})

        result = audit(indexes, all_evals(), max_bits=args.max_bits, min_score=args.min_score)
        shown = {k: loaders[k]() for k in [(q.eval, q.split, q.eval_id) for q in result.pairs[:args.grid]]}
        doc = write_report(result, args.output, evals_meta, grid=args.grid, images=shown)
    _print_coverage(indexes, result.unconfirmed, args.output)
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


def _print_coverage(indexes: list, unconfirmed: list, out: str) -> None:
    """Per shard set, how many of its manifest's samples the audit covered; those it did not are
    named (the first few here, all in audit.json): a pair there cannot have been found. So are the
    candidates that could not be confirmed (their shard changed since it was hashed)."""
    report = Path(out) / "audit.json"
    for idx in indexes:
        where = f"; every one under \"not_audited_samples\" in {report}" if idx.skipped else ""
        print(f"{idx.manifest}: {idx.coverage('audited')}{where}")
    if unconfirmed:
        names = ", ".join(f"{u['shard']}:{u['key']} ({u['reason']})" for u in unconfirmed[:5])
        print(f"{len(unconfirmed)} candidate(s) not confirmed, their samples unreadable since they were hashed "
              f"(rebuild with --force): {names}{', ...' if len(unconfirmed) > 5 else ''}; all under "
              f"\"unconfirmed\" in {report}")


if __name__ == "__main__":
    sys.exit(main())
