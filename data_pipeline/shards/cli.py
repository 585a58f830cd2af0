"""``vit-shards``: the command line of the shard writer (``writer.py``) and of ``vit-shards merge`` (``parts.py``).

    vit-shards --source imagefolder:/data/imagenet21k/train --output /shards/in21k --workers 16
    vit-shards merge /shards/jft /shards/jft/part-*of0064.json
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from data_pipeline.errors import DataError, Parser, cli_errors, path_arg
from data_pipeline.shards.exclude import read_exclusion
from data_pipeline.shards.manifest import MANIFEST_NAME
from data_pipeline.shards.parts import merge_parts, part_manifest_name
from data_pipeline.shards.sources import open_source
from data_pipeline.shards.writer import skipped_line, write_shards
from data_pipeline.storage.places import open_place


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("b")
    mult = units.get(t[-1:], 1)
    try:
        size = int(float(t[:-1] if t[-1:] in units else t) * mult)
    except (ValueError, OverflowError):  # nan, inf
        size = 0
    if size <= 0:  # 0 closed no shard, a negative size closed one after every sample
        raise argparse.ArgumentTypeError(f"expected a positive size like 500000000 or 1G, got {text!r}")
    return size


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _part(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    try:
        part = int(i), int(n)
    except ValueError:
        part = (0, 0)
    if not 1 <= part[0] <= part[1]:
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N (e.g. 3/8), got {text!r}")
    return part


def merge_main(argv) -> int:
    """``vit-shards merge OUT PART_MANIFEST...``"""
    p = Parser(prog="vit-shards merge", description="Check the part manifests of a vit-shards --part I/N job "
               "and write the one manifest.json beside the shards.")
    p.add_argument("out", metavar="OUT", type=path_arg,
                   help="the folder or s3://bucket/prefix holding every part's shards (their --output)")
    p.add_argument("parts", metavar="PART_MANIFEST", nargs="+", type=path_arg,
                   help="part-IIIIofNNNN.json of each part (in a store: their URLs, or a quoted pattern such as "
                        "'s3://b/p/part-*of0064.json')")
    args = p.parse_args(argv)
    with cli_errors("vit-shards merge"):
        try:
            m = merge_parts(args.out, args.parts)
        except OSError as e:
            raise DataError(f"{getattr(e, 'filename', None) or args.out}: {e.strerror or e}") from None
    print(f"{m['total']} samples in {len(m['shards'])} shards of {m['parts']} parts, {len(m['classes'])} classes -> "
          f"{open_place(args.out).url(MANIFEST_NAME)}" + (f"; skipped {m['skipped']}" if m["skipped"] else ""))
    return 0


def parse_args(argv) -> argparse.Namespace:
    """vit-shards' options (not ``merge``): a usage mistake is one line, exit 2. ``vit-launch slurm
    --shards`` checks the options it writes into a job array with this too."""
    p = Parser(prog="vit-shards", description="Write WebDataset shards + manifest.json. "
               "`vit-shards merge OUT PART_MANIFEST...` joins the parts of a --part I/N job.")
    p.add_argument("--source", required=True,
                   help="imagefolder:DIR | cifar100:PATH | filelist:FILE | demo | demo-transfer")
    p.add_argument("--output", required=True, type=path_arg,
                   help="folder (or s3://bucket/prefix) for the shards and manifest.json")
    p.add_argument("--split", default="train", help="shard name prefix; cifar100: train|test, "
                   "demo: train|val, demo-transfer: train|test")
    p.add_argument("--shard-size", type=_positive, default=1000, help="samples per shard")
    p.add_argument("--max-shard-bytes", type=_bytes, default=None, help="also close a shard at this size (e.g. 1G)")
    p.add_argument("--resize-shorter", type=_positive, default=None, help="store images with shorter side <= S")
    p.add_argument("--quality", type=_positive, default=95, help="JPEG/WebP quality when re-encoding")
    p.add_argument("--workers", type=_positive, default=1, help="encoding processes")
    p.add_argument("--shuffle-seed", type=int, default=0, help="sample order in the shards (default 0)")
    p.add_argument("--no-shuffle", action="store_true", help="keep the source order")
    p.add_argument("--limit", type=_positive, default=None, help="write only the first N samples (smoke tests)")
    p.add_argument("--exclude", metavar="FILE", type=path_arg,
                   help="keys to leave out (vit-audit's exclude.txt), from an earlier run of this same command; "
                        "the other samples keep their keys")
    p.add_argument("--allow-empty-classes", action="store_true",
                   help="imagefolder: keep a class folder without images as a class (default: error)")
    p.add_argument("--part", type=_part, metavar="I/N", help="write only part I of N of the job (one per machine), "
                   "with its part manifest; then `vit-shards merge OUT PART_MANIFEST...` writes manifest.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.quality > 100:
        p.error(f"argument --quality: expected 1..100, got {args.quality}")
    if not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]*", args.split):  # it starts every shard's file name
        p.error(f"argument --split: {args.split!r} is not a shard name prefix (letters, digits, '.', '_', '+', "
                "'-'; not a path, not hidden)")
    return args


def output_inside_source(source: str, output: str) -> str | None:
    """The problem with writing an image folder's shards into that folder, or None: the writer's
    next run over it would take the shards' folder for a class (or its only class)."""
    kind, _, path = source.partition(":")
    if kind != "imagefolder" or not path or "://" in output:
        return None
    src, out = Path(path).resolve(), Path(output).resolve()
    if out != src and src not in out.parents:
        return None
    return (f"--output {output} is inside --source {source}: a later run over that folder would take the "
            "shards' folder for a class; write them outside the image folder")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    args = parse_args(argv)

    with cli_errors("vit-shards"):
        problem = output_inside_source(args.source, args.output)
        if problem:
            raise DataError(problem)
        try:
            source = open_source(args.source, args.split, allow_empty_classes=args.allow_empty_classes)
            split = args.split if not args.source.startswith("demo-transfer") else f"transfer-{args.split}"
            m = write_shards(source, args.output, split=split, shard_size=args.shard_size,
                             max_shard_bytes=args.max_shard_bytes, resize_shorter=args.resize_shorter,
                             quality=args.quality, workers=args.workers,
                             shuffle_seed=None if args.no_shuffle else args.shuffle_seed, limit=args.limit,
                             progress=not args.quiet,
                             exclude=read_exclusion(args.exclude) if args.exclude else None, part=args.part)
        except OSError as e:  # unwritable output, disk full: still one line, not a traceback
            raise DataError(f"{getattr(e, 'filename', None) or args.output}: {e.strerror or e}") from None
        except KeyboardInterrupt:
            print("vit-shards: interrupted; rerun the same command to finish the job", file=sys.stderr)
            raise SystemExit(130) from None
    skipped = f"; skipped {m['skipped']}" if m["skipped"] else ""
    written = open_place(args.output).url(part_manifest_name(args.part) if "part" in m else MANIFEST_NAME)
    print(f"{m['total']} samples in {len(m['shards'])} shards, {len(m['classes'])} classes -> {written}{skipped}")
    line = skipped_line(m, written)
    if line:
        print(f"vit-shards: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
