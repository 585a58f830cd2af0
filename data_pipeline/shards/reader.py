"""Read one tar shard into raw samples (bytes only), surviving missing, truncated and hostile shards.

A sample is the run of consecutive members sharing a key (``000042.jpg``, ``000042.cls``), split
with webdataset's own ``base_plus_ext`` so we group exactly as a stock ``wds.WebDataset`` does.
Only members whose extension the decoder understands are read; ``.pyd/.pickle/.pth`` and friends
are skipped *unread* and counted, so nothing in a shard can reach ``pickle`` or ``torch.load``.
Nothing is extracted to disk, so member names like ``../../x`` or symlinks cannot escape.

Remote shards are opened through ``data_pipeline.storage.places`` (``open_shard``).
"""
from __future__ import annotations

import itertools
import tarfile
from dataclasses import dataclass, field
from typing import Iterator, Optional

from webdataset.tariterators import base_plus_ext

from data_pipeline.shards.manifest import Shard
from data_pipeline.storage.places import open_shard
from data_pipeline.storage.retry import RemotePolicy, RemoteShardError
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
    lost: bool = False  # a placeholder for a sample the tar did not deliver (counted as lost_in_shard)
    copy: int = 0  # which of its repeats in a training epoch this reading is (data.repeat_augment)


def read_shard(shard: Shard, tally: Tally, ranges=None, policy: Optional[RemotePolicy] = None) -> Iterator[RawSample]:
    """Yield one item per wanted sample of ``shard``, in order: samples ``lo <= index < hi`` for
    each of ``ranges`` (sorted, disjoint; default the whole shard as the manifest counts it).
    Samples before and between the ranges are skipped unread (headers only); reading stops once the
    last range ends. Whatever the manifest promised in the ranges and the tar did not deliver
    (missing file, truncation, garbage) is counted as ``lost_in_shard`` and comes out as a
    placeholder (``lost=True``, no members): a slot's arrivals are then exactly its planned
    positions, which elastic resume (``rest.py``) relies on. A remote shard the server refuses
    raises ``RemoteShardError`` instead, one it stays away for past ``policy`` ``StoreUnreachable``."""
    ranges = [(0, shard.samples)] if ranges is None else [(lo, hi) for lo, hi in ranges if hi > lo]
    wanted = sum(hi - lo for lo, hi in ranges)
    if not wanted:
        return
    yielded = 0
    failed = False
    try:
        stream = open_shard(shard.url, shard.name, tally, policy)
    except RemoteShardError:
        raise
    except (OSError, ValueError):
        tally.add("missing_shard")
        stream = None
    if stream is not None:
        try:
            for sample in _grouped(stream, shard, tally, ranges):
                yield sample
                yielded += 1
        except RemoteShardError:
            raise
        except (tarfile.TarError, OSError, EOFError, ValueError):
            # Truncated or garbled tar: the partial sample in flight is dropped with the rest.
            failed = True
        finally:  # also runs when the consumer stops early (GeneratorExit): then nothing is counted
            try:
                stream.close()
            except Exception:  # a remote pipe reports its exit status on close; counted below
                failed = True
        if failed or yielded < wanted:
            tally.add("truncated_tar")
    if yielded < wanted:
        tally.bad("lost_in_shard", shard.name, wanted - yielded)
        # the tar delivers in index order, so what is missing is the tail of the wanted indices
        for index in itertools.islice((i for lo, hi in ranges for i in range(lo, hi)), yielded, None):
            yield RawSample(shard=shard, index=index, key="", lost=True)


def _grouped(stream, shard: Shard, tally: Tally, ranges) -> Iterator[RawSample]:
    """Group members into samples; yields a wanted sample once the next key starts (or the tar
    ends). Members of unwanted samples are neither read nor counted."""
    sample, key_now, index, r = None, None, -1, 0
    stop = ranges[-1][1]
    for info, read in _members(stream):
        if not info.isreg():
            continue
        key, ext = base_plus_ext(info.name)
        if key is None:
            continue
        if key != key_now:
            if sample is not None:
                yield sample
            index += 1
            if index >= stop:
                return
            while ranges[r][1] <= index:
                r += 1
            key_now = key
            sample = RawSample(shard=shard, index=index, key=key) if ranges[r][0] <= index else None
        if sample is None:  # outside the ranges: the tar skips the member's bytes
            continue
        ext = ext.lower()
        if ext in UNSAFE_EXTS:
            tally.add("unsafe_member")
        elif ext not in IMAGE_EXTS and ext not in LABEL_EXTS:
            tally.add("unknown_member")
        elif info.size > MAX_MEMBER_BYTES:
            tally.add("oversized_member")
        else:
            sample.members[ext] = read()
    if sample is not None:
        yield sample


_BLOCK = tarfile.BLOCKSIZE
_COMPRESSED = (b"\x1f\x8b\x08", b"BZh91", b"\xfd7zXZ", b"\x5d\x00\x00\x80")  # what mode "r|*" detects
_PLAIN = (tarfile.REGTYPE, tarfile.AREGTYPE)


def _members(stream) -> Iterator[tuple]:
    """(TarInfo, read) for each member that ``tarfile.open(fileobj=stream, mode="r|*")`` iterates,
    with the same errors; ``read()`` gives the member's bytes (call it before the next member, at
    most once), and a member not read is skipped. A seekable uncompressed stream is read here as
    long as its headers are plain regular files (most shards): each header parsed by tarfile's own
    ``TarInfo.frombuf``, the bytes read straight from the stream, without tarfile's stream layer
    (which copies every member through 10 KB chunks). From the first header of another kind (pax
    or GNU extensions, links, directories), or for a compressed or unseekable stream, tarfile
    reads on from that header. The checks are tarfile's: a bad or short header ends the archive
    (the first one is an error), and a member whose bytes or padding the file cuts short is a
    ``ReadError``."""
    plain = hasattr(stream, "peek") and getattr(stream, "seekable", bool)()
    if plain and not stream.peek(8)[:8].startswith(_COMPRESSED):
        pos, first = stream.tell(), True
        while True:
            try:
                info = tarfile.TarInfo.frombuf(stream.read(_BLOCK), tarfile.ENCODING, "surrogateescape")
            except tarfile.HeaderError:
                if not first:
                    return  # tarfile ends the archive here
                stream.seek(pos)  # tarfile raises its own error for the first header
                break
            if info.type not in _PLAIN or not info.isreg():
                stream.seek(pos)
                break
            first, size = False, info.size
            end = pos + _BLOCK + -(-size // _BLOCK) * _BLOCK  # the data padded to whole blocks
            yield info, lambda: _read_exactly(stream, size)
            if size:  # the file must reach the end of the padding, as tarfile's next() checks
                stream.seek(end - 1)
                if not stream.read(1):
                    raise tarfile.ReadError("unexpected end of data")
            pos = end
    tar = tarfile.open(fileobj=stream, mode="r|*")
    for info in tar:
        tar.members = []  # streaming: do not keep every TarInfo of a 10k-sample shard in memory
        yield info, lambda info=info: tar.extractfile(info).read()


def _read_exactly(stream, size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise tarfile.ReadError("unexpected end of data")
    return data
