"""``vit-shards``: write WebDataset tar shards and ``manifest.json`` from a dataset.

    vit-shards --source imagefolder:/data/imagenet21k/train --output /shards/in21k \\
               --shard-size 1000 --resize-shorter 320 --workers 16
    vit-shards --source cifar100:/data/cifar-100-python.tar.gz --split test --output /shards/c100-test
    vit-shards --source filelist:labels.tsv --output /shards/jft      # path<TAB>3,17,512 = multi-label
    vit-shards --source demo --output demo_out/shards/train            # built-in, no download
    python -m data_pipeline.write_shards ...                           # the same
    vit-shards --source imagefolder:/data/jft --output /shards/jft --part 3/64   # part 3 of 64, one per machine
    vit-shards merge /shards/jft /shards/jft/part-*of0064.json                   # then: manifest.json

Each sample is ``<key>.jpg`` (``.png``/``.webp`` when the source image is such and needs no
re-encoding), ``<key>.cls`` (first label as text) and, for multi-label data, ``<key>.json``
(``{"labels": [...]}``), so any stock ``webdataset.WebDataset`` reader reads the shards.
``--resize-shorter S`` stores images with shorter side at most S: decoding a pre-resized JPEG is
the single biggest saving of the training loader (benchmarks/results/loader-throughput-cpu.md). Files copied as
they are (no resize needed, 8-bit without transparency) keep their bytes and are decoded once, a
JPEG at 1/8 scale, so that a truncated one is not stored; others go through ``decode.to_8bit``
(EXIF orientation, alpha over white, 16-bit scaled), the loader's own mapping. Files that do not
decode whole are skipped, counted in the manifest's ``skipped`` and named in its
``skipped_files`` (the first 1,000 per reason) and in one line on stderr; the loader counts any
that fail later. An imagefolder class folder without images is an error unless
``--allow-empty-classes``.

Crash safety: a shard is written under a temporary name and renamed when complete; the list of
finished shards is kept in ``.vit-shards-progress.json`` and ``manifest.json`` is written last.
Rerunning the same command after an interruption keeps the finished shards and continues; with a
different source or options it refuses to mix the two jobs.

``--output s3://bucket/prefix`` (``storage.places``, ``storage.s3``): each shard streams into a
multipart upload (parts of 8 MiB: no shard in memory or on local disk) completed when the shard
is, the progress file is an object beside the shards recording each finished shard's size and
ETag (a rerun keeps a shard only if both still match, and aborts the uploads a killed run left),
and ``manifest.json`` is written last. Any other URL scheme is a one-line error.

Many machines (``--part I/N``): the job's sample order (same source and options, so the same keys)
is cut into N runs of whole nominal shards (``part_range``); part I writes its run as
``<split>-IIIIofNNNN-<j>.tar`` into the shared ``--output`` with its own progress file, and ends
with ``part-IIIIofNNNN.json``. Parts may run at once and be rerun alone. ``vit-shards merge`` checks
the N part manifests (``merge_parts``) and writes ``manifest.json``: the same samples, labels and
keys as the one-process job. ``vit-launch slurm --shards`` writes this as a SLURM job array.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field

from PIL import Image

from data_pipeline.errors import DataError
from data_pipeline.shards.decode import to_8bit
from data_pipeline.shards.demo_data import demo_items
from data_pipeline.shards.exclude import Exclusion
from data_pipeline.shards.manifest import (
    FORMAT,
    MANIFEST_NAME,
    SKIPPED_NAMES,
    VERSION,
    manifest_text,
    shard_problem,
)
from data_pipeline.shards.parts import (
    PART_FORMAT,
    part_manifest_name,
    part_range,
    part_tag,
)
from data_pipeline.shards.sources import Source
from data_pipeline.storage.places import open_place

PROGRESS_NAME = ".vit-shards-progress.json"
_KEEP = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # formats stored as they come
# Formats read from sources (converted to JPEG unless kept); no plugin that runs external programs.
_SOURCE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "PPM")
_TAR_BLOCK = 512


def encode_item(args):
    """(item, resize_shorter, quality) -> (bytes, ext) or (None, reason). Runs in worker processes."""
    item, shorter, quality = args
    if item is None:  # listed in --exclude: not even read
        return None, "excluded"
    try:
        obj = item.load()
    except OSError:
        return None, "unreadable"
    fmt, lossless = "JPEG", False
    if isinstance(obj, bytes):
        try:
            img = Image.open(io.BytesIO(obj), formats=_SOURCE_FORMATS)
            fmt = img.format
            lossless = fmt == "WEBP" and _webp_lossless(obj)
            if fmt in _KEEP and (shorter is None or min(img.size) <= shorter) and _plain(img):
                _decode_whole(img)  # a truncated file would pass on its header alone
                return obj, _KEEP[fmt]  # copied as-is: no generation loss, no encode cost
            if fmt == "JPEG" and shorter:
                img.draft("RGB", _resized(img.size, shorter))
            img.load()
        except Image.DecompressionBombError:
            return None, "too_large"
        except Exception:  # any decode failure of a source file: skipped and counted
            return None, "unreadable"
    else:
        img = obj
    try:  # oriented, alpha over white, 16-bit scaled: the loader's own mapping (decode.to_8bit)
        img = to_8bit(img)
    except Exception:
        return None, "unreadable"
    if shorter is not None and min(img.size) > shorter:
        img = img.resize(_resized(img.size, shorter), Image.BICUBIC, reducing_gap=3.0)
    out_fmt = fmt if fmt in ("PNG", "WEBP") else "JPEG"
    buf = io.BytesIO()
    if out_fmt == "PNG":
        img.save(buf, "PNG")
    elif out_fmt == "JPEG" and min(img.size) <= 64:
        # Tiny images (CIFAR's 32 px): 4:2:0 chroma subsampling would halve an already tiny colour
        # resolution; full-resolution chroma costs little at this size.
        img.save(buf, "JPEG", quality=quality, subsampling=0)
    elif lossless:  # a lossless WebP (e.g. with alpha, composited here) stays lossless
        img.save(buf, "WEBP", lossless=True, exact=True)
    else:
        img.save(buf, out_fmt, quality=quality)
    return buf.getvalue(), _KEEP[out_fmt]


def _decode_whole(img: Image.Image) -> None:
    """Decode every byte of a file about to be stored as it is; raise where PIL cannot (a truncated
    or damaged file), as the loader's decode would. A JPEG is decoded at 1/8 scale (libjpeg's DCT
    scaling still reads the whole entropy-coded stream): about a third of a full decode."""
    if img.format == "JPEG":
        img.draft("RGB", (max(1, img.size[0] // 8), max(1, img.size[1] // 8)))
    img.load()


def _plain(img: Image.Image) -> bool:
    """Stored as it comes only when any reader's ``convert("RGB")`` gets the right pixels: 8-bit
    grey/colour/palette without transparency. 16-bit, alpha and CMYK files are converted once
    here (a lossless PNG stays PNG). EXIF orientation is kept in copied files (the loader applies
    it) so a JPEG is not re-encoded just to turn it; a stock reader should call
    ``ImageOps.exif_transpose``."""
    return img.mode in ("RGB", "L", "P", "1") and "transparency" not in img.info


def _webp_lossless(data: bytes) -> bool:
    """Whether a WebP file's image chunk is VP8L (lossless) rather than VP8 (lossy)."""
    pos = 12  # after "RIFF" size "WEBP"
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        if kind in (b"VP8L", b"VP8 "):
            return kind == b"VP8L"
        pos += 8 + size + (size & 1)
    return False


def _resized(size, shorter):
    w, h = size
    s = shorter / min(w, h)
    return max(1, round(w * s)), max(1, round(h * s))


def _member_bytes(n: int) -> int:
    return _TAR_BLOCK + -(-n // _TAR_BLOCK) * _TAR_BLOCK


class _ShardSink:
    """Writes samples into ``<prefix>-NNNNNN.tar`` files of ``out`` (``storage.places``), starting a
    new shard when the current one holds ``shard_size`` samples or the next sample would take it past
    ``max_shard_bytes``. Each shard streams under a temporary name (a multipart upload in S3) that
    becomes the file when complete, then is recorded in the progress file (finished shards with
    their size and the store's ETag + where the next one starts in the sample order + skip counts
    so far). ``shards``: the finished shards of an interrupted run, extended in place."""

    def __init__(self, out, prefix: str, progress: str, job: str, shards: list, shard_size: int,
                 max_shard_bytes: int | None):
        self.out, self.prefix, self.progress, self.job = out, prefix, progress, job
        self.shards, self.shard_size, self.max_shard_bytes = shards, shard_size, max_shard_bytes
        last = shards[-1] if shards else {}  # skip counts go on from where the last finished shard left them
        self.skipped = Counter(last.get("skipped", {}))
        self.skipped_files = {k: list(v) for k, v in last.get("skipped_files", {}).items()}  # the first SKIPPED_NAMES
        self.current = None  # (output stream, TarWriter, name)
        self.count = self.size = 0

    def skip(self, reason: str, item, index: int) -> None:
        self.skipped[reason] += 1
        names = self.skipped_files.setdefault(reason, [])
        if len(names) < SKIPPED_NAMES:
            names.append(_item_name(item, index))

    def add(self, position: int, sample: dict) -> None:
        """Sample ``position`` of the job's order; it may close the current shard first."""
        import webdataset as wds

        need = sum(_member_bytes(len(v)) for k, v in sample.items() if k != "__key__")
        if self.current and (self.count >= self.shard_size or
                             (self.max_shard_bytes and self.size + need > self.max_shard_bytes)):
            self.finish(position)
        if self.current is None:
            name = f"{self.prefix}-{len(self.shards):06d}.tar"
            f = self.out.create(name)
            self.current, self.count, self.size = (f, wds.TarWriter(f, mtime=0), name), 0, 0
        self.current[1].write(sample)
        self.count, self.size = self.count + 1, self.size + need

    def finish(self, end: int) -> None:
        """Close the current shard (if any); the next one starts at ``end`` in the sample order."""
        if self.current is None:
            return
        f, writer, name = self.current
        writer.close()
        done = f.commit()  # {"bytes"}, and the store's "etag" for S3
        self.shards.append({"name": name, "samples": self.count, "bytes": done["bytes"],
                            **({"etag": done["etag"]} if done.get("etag") else {}),
                            "end": end, "skipped": dict(self.skipped),
                            "skipped_files": {k: list(v) for k, v in self.skipped_files.items()}})
        self.out.write_text(self.progress, json.dumps({"job": self.job, "shards": self.shards}))
        self.current = None

    def abandon(self) -> None:
        """After an error or Ctrl-C: drop the unfinished shard (after kill -9 the next run does)."""
        if self.current is not None:
            f, writer, _ = self.current
            with contextlib.suppress(Exception):
                writer.close()
            f.abort()
            self.current = None


def _job_done(out, name: str, job: str, other: str):
    """The manifest ``name`` in ``out`` when this job already finished it (a rerun returns it), None
    when there is none; another job's is a DataError (``other`` says what to do)."""
    text = out.read_text(name)
    if text is None:
        return None
    done = json.loads(text)
    if done.get("job") != job:
        raise DataError(f"{out.url(name)}: {other}")
    return done


def _check_still_whole(out, done: dict, part: tuple[int, int] | None) -> None:
    """A finished job (or part) that a rerun would return as it is: every shard its manifest lists
    must still be there with the size written, else a DataError naming the first that is not and
    what rewrites it (the manifest's presence is what makes a rerun a no-op)."""
    for s in done["shards"]:
        why = shard_problem(out, s)
        if why is None:
            continue
        if done.get("format") == PART_FORMAT:  # this part's own manifest
            remove = [part_manifest_name(part)]
        else:  # the job's manifest.json: a part's shard also needs that part's manifest gone
            m = re.fullmatch(r".*-(\d{4})of(\d{4})-\d+\.tar", s["name"])
            remove = [MANIFEST_NAME] + ([part_manifest_name((int(m[1]), int(m[2])))] if m else [])
            part = (int(m[1]), int(m[2])) if m else None
        again = f"rerun with --part {part[0]}/{part[1]}" if part else "rerun"
        then = ", then vit-shards merge" if part and MANIFEST_NAME in remove else ""
        raise DataError(f"{out.url(s['name'])}: {why} since the job finished; remove "
                        f"{' and '.join(out.url(n) for n in remove)} and {again} to write it again{then}")


def _finished_shards(out, job: str, name: str) -> list:
    """Shards an interrupted run of the same job completed (files still intact: the size, and in
    S3 the ETag, the progress file recorded)."""
    text = out.read_text(name)
    if text is None:
        return []
    state = json.loads(text)
    if state.get("job") != job:
        raise DataError(f"{out.url(name)}: an interrupted job with another source or options is in "
                        "this folder; rerun that command, or use another --output")
    shards = []
    for rec in state["shards"]:
        st = out.stat(rec["name"])
        if st is None or st["bytes"] != rec["bytes"] or rec.get("etag", st.get("etag")) != st.get("etag"):
            break
        shards.append(rec)
    return shards


@dataclass
class ShardJob:
    """One ``vit-shards`` job: a source and the options that fix what its shards hold. ``id`` (the
    manifest's ``"job"``) hashes both, once, here: a rerun with the same ones continues or returns
    the job, another refuses to mix with it, and ``vit-audit`` names it in exclusion lists.
    ``exclude`` (``exclude.Exclusion``): keys of this same job to leave out (a key is a position in
    the job's sample order, so a list written for another job is refused); the others keep their
    keys, the left-out ones count as ``skipped["excluded"]``, and the list's hash joins the options."""
    source: Source = field(repr=False)
    split: str = "train"
    shard_size: int = 1000
    max_shard_bytes: int | None = None
    resize_shorter: int | None = None
    quality: int = 95
    shuffle_seed: int | None = 0
    limit: int | None = None
    exclude: Exclusion | None = field(default=None, repr=False)
    options: dict = field(init=False)  # as the manifest records them
    id: str = field(init=False)

    def __post_init__(self) -> None:
        self.options = {"split": self.split, "shard_size": self.shard_size, "max_shard_bytes": self.max_shard_bytes,
                        "resize_shorter": self.resize_shorter, "quality": self.quality,
                        "shuffle_seed": self.shuffle_seed, "limit": self.limit}
        if self.exclude is not None:
            audited = self._digest()  # the job whose keys the list must name
            if self.exclude.jobs and audited not in self.exclude.jobs:
                raise DataError(f"{self.exclude.path}: lists keys of vit-shards job {', '.join(self.exclude.jobs)}, "
                                f"but this source and these options make job {audited}; rerun the audited command "
                                "with --exclude")
            self.options["exclude"] = hashlib.sha1("\n".join(sorted(self.exclude.keys)).encode()).hexdigest()[:16]
        self.id = self._digest()

    def _digest(self) -> str:
        what = [self.source.description, self.source.classes, len(self.source.items), self.options]
        return hashlib.sha1(json.dumps(what).encode()).hexdigest()[:16]

    def finished(self, out, part: tuple[int, int] | None) -> dict | None:
        """The manifest a finished run of this job (or of this part of it) left in ``out``, else None;
        another job's is a DataError."""
        done = _job_done(out, MANIFEST_NAME, self.id, "the folder already holds shards of another source or "
                         "options; use another --output or remove it")
        if done is None and part is not None:
            done = _job_done(out, part_manifest_name(part), self.id, "this part was written by another source or "
                             "options; use another --output or remove the folder's parts")
        return done

    def order(self) -> list[int]:
        """Source indices in the job's sample order: the sample at position ``i`` has key ``i``."""
        order = list(range(len(self.source.items)))
        if self.shuffle_seed is not None:  # class-sorted sources (imagefolder) must not stay sorted in shards
            random.Random(self.shuffle_seed).shuffle(order)
        return order[:self.limit]

    def tasks(self, order: list[int], start: int, stop: int):
        """``encode_item``'s arguments for positions ``start..stop-1``; a left-out key's item is not even read."""
        skip = self.exclude.keys if self.exclude is not None else frozenset()
        return ((None if f"{i:09d}" in skip else self.source.items[order[i]], self.resize_shorter, self.quality)
                for i in range(start, stop))

    def sample(self, position: int, item, data: bytes, ext: str) -> dict:
        sample = {"__key__": f"{position:09d}", ext: data}
        if item.labels:
            sample["cls"] = str(item.labels[0])
        if self.source.multi_label:
            sample["json"] = json.dumps({"labels": list(item.labels)})
        return sample

    def manifest(self, shards: list, sink: _ShardSink, part: tuple[int, int] | None, span: tuple[int, int],
                 samples: int) -> dict:
        """``manifest.json``, or for ``part`` its part manifest: which part, which ``span`` of the job's
        ``samples`` (what ``merge_parts`` checks)."""
        manifest = {
            "format": FORMAT, "version": VERSION, "split": self.split, "source": self.source.description,
            "classes": list(self.source.classes), "multi_label": bool(self.source.multi_label),
            "total": sum(s["samples"] for s in shards),
            "shards": [{k: s[k] for k in ("name", "samples", "bytes")} for s in shards],
            "options": self.options, "skipped": dict(sink.skipped), "skipped_files": sink.skipped_files,
            "job": self.id,
        }
        if part is not None:
            manifest.update(format=PART_FORMAT, part=part[0], parts=part[1], range=list(span), job_samples=samples)
        return manifest


@contextlib.contextmanager
def _encoded(tasks, workers: int, some: bool):
    """``encode_item`` over ``tasks``, in order (shard contents are deterministic): in ``workers``
    processes when there are several and ``some`` work is left, else here."""
    if workers <= 1 or not some:
        yield map(encode_item, tasks)
        return
    import multiprocessing

    pool = multiprocessing.get_context().Pool(workers)
    try:
        yield pool.imap(encode_item, tasks, chunksize=16)
    finally:
        pool.terminate()


def write_shards(source, out_dir, *, workers: int = 1, progress: bool = True, part: tuple[int, int] | None = None,
                 **options) -> dict:
    """Write ``source`` (see ``sources.py``) as shards into ``out_dir``; return the manifest.
    ``options`` are ``ShardJob``'s (``split``, ``shard_size``, ``max_shard_bytes``, ``resize_shorter``,
    ``quality``, ``shuffle_seed``, ``limit``, ``exclude``). Idempotent: a finished job returns its
    manifest, an interrupted one is completed. ``workers`` processes encode the images.
    ``part=(I, N)``: write only part I of N (``part_range``) as ``<split>-IIIIofNNNN-<j>.tar`` and the
    part manifest ``part-IIIIofNNNN.json`` (returned); ``merge_parts`` turns the N part manifests into
    ``manifest.json``. Keys, samples and labels are those the one-process job gives them; parts of
    one job may run at once in one folder, and a rerun of a part redoes only that part.
    ``out_dir``: a folder or ``s3://bucket/prefix`` (``storage.places.open_place``)."""
    from tqdm import tqdm

    job = ShardJob(source, **options)
    out = open_place(out_dir)
    out.prepare()
    done = job.finished(out, part)
    if done is not None:
        _check_still_whole(out, done, part)
        return done
    prefix, progress_path, manifest_name = job.split, PROGRESS_NAME, MANIFEST_NAME
    if part is not None:
        prefix, progress_path = f"{job.split}-{part_tag(part)}", f".vit-shards-progress-{part_tag(part)}.json"
        manifest_name = part_manifest_name(part)
    shards = _finished_shards(out, job.id, progress_path)
    out.clean_unfinished(re.compile(rf"{re.escape(prefix)}-\d+\.tar"))  # this job's (or part's) unfinished shards

    order = job.order()
    lo, hi = part_range(len(order), job.shard_size, part) if part is not None else (0, len(order))
    start = shards[-1]["end"] if shards else lo
    sink = _ShardSink(out, prefix, progress_path, job.id, shards, job.shard_size, job.max_shard_bytes)
    desc = f"vit-shards {job.split}" + (f" part {part[0]}/{part[1]}" if part else "")
    with _encoded(job.tasks(order, start, hi), workers, hi > start) as results:
        try:
            bar = tqdm(total=hi - lo, initial=start - lo, disable=not progress, unit="img", desc=desc)
            for i, (data, ext) in enumerate(results, start):
                bar.update(1)
                item = source.items[order[i]]
                if data is None:  # ext: why it was skipped
                    sink.skip(ext, item, order[i])
                else:
                    sink.add(i, job.sample(i, item, data, ext))
            sink.finish(hi)
            bar.close()
        finally:
            sink.abandon()
    if not shards and part is None:
        raise DataError(f"{source.description}: no readable images ({dict(sink.skipped)})")
    manifest = job.manifest(shards, sink, part, (lo, hi), len(order))
    out.write_text(manifest_name, manifest_text(manifest))  # last: its presence means every listed shard is complete
    out.remove(progress_path)
    return manifest


def _item_name(item, index: int) -> str:
    return getattr(item, "name", "") or getattr(item, "path", "") or f"item {index} of the source"


def skipped_summary(counts: dict, names: list, show: int = 5) -> str:
    """``skipped N files (reason: count, ...): name, name, ...``: the counts by reason and the first
    ``show`` of ``names`` (the skipped files in order), as vit-shards and vit-analyze print them."""
    total = sum(counts.values())
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    shown = ", ".join(names[:show]) + (", ..." if total > len(names[:show]) else "")
    return f"skipped {total} file{'s' * (total != 1)} ({kinds}): {shown}"


def skipped_line(manifest: dict, manifest_path, show: int = 5) -> str:
    """One line naming the first few skipped files and where the rest are listed ('' if none)."""
    counts = manifest.get("skipped") or {}
    if not counts:
        return ""
    names = [n for v in (manifest.get("skipped_files") or {}).values() for n in v]
    where = "all names" if len(names) == sum(counts.values()) else f"the first {SKIPPED_NAMES} of each kind"
    return f"{skipped_summary(counts, names, show)}; {where} under \"skipped_files\" in {manifest_path}"


def write_demo_shards(out_dir, split: str = "train", n: int | None = None, shard_size: int = 256,
                      seed: int = 0, quality: int = 90, workers: int = 1, progress: bool = False) -> dict:
    """Write a demo split as shards + manifest.json into ``out_dir``; returns the manifest."""
    classes, items = demo_items(split, n, seed)
    source = Source(f"demo:{split}", classes, items)
    return write_shards(source, out_dir, split=split, shard_size=shard_size, quality=quality,
                        workers=workers, progress=progress)
