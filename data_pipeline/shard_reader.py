"""Read one tar shard into raw samples (bytes only), surviving missing, truncated and hostile shards.

A sample is the run of consecutive members sharing a key (``000042.jpg``, ``000042.cls``), split
with webdataset's own ``base_plus_ext`` so we group exactly as a stock ``wds.WebDataset`` does.
Only members whose extension the decoder understands are read; ``.pyd/.pickle/.pth`` and friends
are skipped *unread* and counted, so nothing in a shard can reach ``pickle`` or ``torch.load``.
Nothing is extracted to disk, so member names like ``../../x`` or symlinks cannot escape.
"""
from __future__ import annotations

import tarfile
from dataclasses import dataclass, field
from typing import Iterator

from webdataset.tariterators import base_plus_ext

from data_pipeline.manifest import Shard, is_remote, local_path
from data_pipeline.tally import Tally

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTS = ("cls", "json", "txt")
# Extensions stock webdataset decoders would unpickle / torch.load: refused, counted as unsafe.
UNSAFE_EXTS = frozenset({"pyd", "pickle", "pkl", "pth", "pt", "ckpt", "npy", "npz", "joblib", "mp"})
MAX_MEMBER_BYTES = 64 << 20  # larger members are skipped unread: no image we train on is that big


@dataclass
class RawSample:
    shard: Shard
    index: int  # position of the sample within its shard
    key: str
    members: dict = field(default_factory=dict)  # extension -> bytes


def open_shard(url: str):
    if is_remote(url):  # allowed only when data.allow_remote was checked in resolve_shards
        from webdataset.gopen import gopen

        return gopen(url, "rb")
    return open(local_path(url), "rb", buffering=1 << 20)


def read_shard(shard: Shard, tally: Tally) -> Iterator[RawSample]:
    """Yield the complete samples of ``shard``. Whatever the manifest promised and the tar did not
    deliver (missing file, truncation, garbage) is counted as ``lost_in_shard`` samples."""
    yielded = 0
    failed = False
    try:
        stream = open_shard(shard.url)
    except (OSError, ValueError):
        tally.add("missing_shard")
        tally.bad("lost_in_shard", shard.name, shard.samples)
        return
    try:
        for sample in _grouped(stream, shard, tally):
            yield sample
            yielded += 1
    except (tarfile.TarError, OSError, EOFError, ValueError):
        # Truncated or garbled tar: the partial sample in flight is dropped with the rest.
        failed = True
    finally:  # also runs when the consumer stops early (GeneratorExit): then nothing is counted
        try:
            stream.close()
        except Exception:  # a remote pipe reports its exit status on close; counted below
            failed = True
    if failed or yielded < shard.samples:
        tally.add("truncated_tar")
        tally.bad("lost_in_shard", shard.name, max(0, shard.samples - yielded))


def _grouped(stream, shard: Shard, tally: Tally) -> Iterator[RawSample]:
    """Group members into samples; yields a sample once the next key starts (or the tar ends)."""
    tar = tarfile.open(fileobj=stream, mode="r|*")
    sample = None
    index = 0
    for info in tar:
        if not info.isreg():
            continue
        key, ext = base_plus_ext(info.name)
        if key is None:
            continue
        ext = ext.lower()
        if sample is None or key != sample.key:
            if sample is not None:
                yield sample
                index += 1
            sample = RawSample(shard=shard, index=index, key=key)
        if ext in UNSAFE_EXTS:
            tally.add("unsafe_member")
        elif ext not in IMAGE_EXTS and ext not in LABEL_EXTS:
            tally.add("unknown_member")
        elif info.size > MAX_MEMBER_BYTES:
            tally.add("oversized_member")
        else:
            sample.members[ext] = tar.extractfile(info).read()
        tar.members = []  # streaming: do not keep every TarInfo of a 10k-sample shard in memory
    if sample is not None:
        yield sample
