"""The hashing half of ``vit-audit`` (``audit.py`` has the method and its calibration): the
hashes of an image, the confirmation of a candidate pair, the multi-index table that finds
pHashes within a few bits, and the pre-training side's stored index (``hashes.npz`` beside a
manifest, in its folder or ``s3://`` prefix, built once by ``vit-audit --index`` or the first
audit).
"""
from __future__ import annotations

import hashlib
import io
import json
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
from PIL import Image, ImageFilter

from data_pipeline.errors import DataError
from data_pipeline.shards.decode import BadSample, load_rgb, open_image
from data_pipeline.shards.manifest import MANIFEST_NAME, ShardSet, read_manifest, resolve_shards
from data_pipeline.shards.reader import read_shard
from data_pipeline.storage.places import LocalFolder, open_place
from data_pipeline.storage.retry import RemoteShardError
from data_pipeline.storage.s3 import S3Prefix
from data_pipeline.storage.urls import is_s3
from data_pipeline.tally import Tally

HASHES_NAME = "hashes.npz"
HASH_KIND = "blake2b8-rgb+imagehash4-phash8"  # stored in the index; another kind means rebuild
INDEX_VERSION = 2  # hashes.npz layout: 2 names every sample without a row; another version means rebuild
MAX_BITS = 12  # candidate: pHash distance to the nearest probe (calibrated, see module doc)
MIN_SCORE = 0.7  # confirmation: high-pass NCC of aligned 32x32 thumbnails (calibrated)
MIN_DETAIL = 0.5  # ... and of the same boxes' finer detail, each region weighted alike (calibrated)
MAX_PIXELS = 89_478_485  # decompression-bomb guard, as data.max_image_pixels
_SMALL = 256  # perceptual work happens on a grey copy at most this big: same on both sides

# Crop boxes (left, top, right, bottom as fractions) probed on each evaluation image: per axis, cut
# 0, 5% or 10% in total, split between the two sides (0/all, all/0, half/half); boxes whose two
# axes together cut more than ~15% of the area are left out. Residual misalignment <= 2.5% a side.
_AXIS = {0.0: [(0.0, 0.0)], 0.05: [(0.0, 0.05), (0.05, 0.0), (0.025, 0.025)],
         0.1: [(0.0, 0.1), (0.1, 0.0), (0.05, 0.05)]}
PROBES = tuple((left, top, 1 - right, 1 - bottom)
               for sx, sy in ((0.0, 0.0), (0.0, 0.05), (0.05, 0.0), (0.0, 0.1), (0.1, 0.0), (0.05, 0.05))
               for left, right in _AXIS[sx] for top, bottom in _AXIS[sy])
# Of the mirror image, the whole and the 5% cuts of one axis: a flipped copy cropped by more is
# rarer, and each probe costs lookup time (all 22 took 9.5 s for 1M x 10k, against a 10 s target)
MIRROR_PROBES = PROBES[:7]
N_PROBES = len(PROBES) + len(MIRROR_PROBES)


# ------------------------------------------------------------------------------------- hashes
def pixel_hash(img: Image.Image) -> int:
    """Exact duplicate test: 64 bits of BLAKE2b over the decoded RGB pixels and the size."""
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{rgb.size[0]}x{rgb.size[1]}".encode())
    h.update(rgb.tobytes())
    return int.from_bytes(h.digest(), "big")


def _grey_small(img: Image.Image) -> Image.Image:
    g = img.convert("L")
    if max(g.size) > _SMALL:
        g = g.copy()
        g.thumbnail((_SMALL, _SMALL), Image.BILINEAR, reducing_gap=2.0)
    return g


def phash64(grey: Image.Image) -> int:
    import imagehash

    bits = imagehash.phash(grey).hash.ravel()
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def _box(img: Image.Image, box) -> Image.Image:
    w, h = img.size
    left, top, right, bottom = box
    return img.crop((round(left * w), round(top * h), max(round(right * w), round(left * w) + 1),
                     max(round(bottom * h), round(top * h) + 1)))


def _mirror(img: Image.Image) -> Image.Image:
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


def probe_hashes(img: Image.Image) -> np.ndarray:
    """pHashes of the ``PROBES`` crops of an evaluation image, then the ``MIRROR_PROBES`` crops of
    its mirror image (``N_PROBES`` in all; the first is the whole image). A horizontally flipped copy (the most
    common augmentation) moves a pHash by ~30 bits: its odd horizontal frequencies change sign."""
    g = _grey_small(img)
    m = _mirror(g)
    return np.array([phash64(_box(g, b)) for b in PROBES] + [phash64(_box(m, b)) for b in MIRROR_PROBES],
                    dtype=np.uint64)


def train_hashes(img: Image.Image) -> tuple[int, int]:
    """(exact, perceptual) hash of a pre-training image."""
    return pixel_hash(img), phash64(_grey_small(img))


# ----------------------------------------------------------------------------- confirmation
def _unit(a: np.ndarray) -> np.ndarray:
    a = a - a.mean()
    n = float(np.linalg.norm(a))
    return a / n if n > 1e-3 else np.zeros_like(a)  # a flat image correlates with nothing


def _highpass(grey: Image.Image, size: int) -> np.ndarray:
    """A ``size`` x ``size`` thumbnail minus its Gaussian blur (sigma 3 px), float32."""
    t = grey.resize((size, size), Image.BILINEAR, reducing_gap=2.0)
    return np.asarray(t, dtype=np.float32) - np.asarray(t.filter(ImageFilter.GaussianBlur(3)), dtype=np.float32)


def _highpass32(grey: Image.Image) -> np.ndarray:
    return _unit(_highpass(grey, 32))


def _blur(a: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of a float array, edges mirrored."""
    k = np.exp(-0.5 * (np.arange(-int(3 * sigma), int(3 * sigma) + 1) / sigma) ** 2)
    k /= k.sum()
    r = len(k) // 2
    for axis in (0, 1):
        p = np.pad(a, [(r, r) if ax == axis else (0, 0) for ax in (0, 1)], mode="reflect")
        a = np.lib.stride_tricks.sliding_window_view(p, len(k), axis=axis) @ k
    return a


def _detail64(grey: Image.Image) -> np.ndarray:
    """The 64x64 high-pass divided by its local contrast (RMS over ~4 px, plus 2 grey levels so
    flat regions and JPEG noise stay near zero): every textured region counts alike, so one
    strong edge -- a symmetric object's outline -- cannot carry a match its surroundings deny."""
    h = _highpass(grey, 64)
    return _unit(h / (np.sqrt(_blur(h * h, 4.0)) + 2.0))


@dataclass
class Match:
    score: float  # high-pass NCC of the aligned 32x32 thumbnails (MIN_SCORE)
    detail: float  # local-contrast NCC of the same boxes at 64x64 (MIN_DETAIL)
    mirrored: bool  # the match is with the evaluation image's mirror image


def confirm(eval_img: Image.Image, train_img: Image.Image, *, min_score: float = MIN_SCORE,
            min_detail: float = MIN_DETAIL, mirrored: tuple = (False, True)) -> Optional[Match]:
    """The best confirmed match of ``train_img`` with a slightly cropped box of ``eval_img``
    (``mirrored`` False) or of its mirror image (True) among the orientations in ``mirrored``,
    or None. Both orientations pass the same two checks: the box search (:func:`_align`) reaches
    ``min_score``, and at that box the finer detail agrees (``min_detail``). The best is the one of
    higher score; a tie is not a mirror copy."""
    tg = _grey_small(train_img)
    ref, g = _highpass32(tg), _grey_small(eval_img)
    best = None
    for flip in sorted(mirrored):  # direct first: it wins a tie
        view = _mirror(g) if flip else g
        score, box = _align(view, ref)
        if score < min_score or (best is not None and score <= best.score):
            continue
        detail = _detail(view, box, _detail64(tg))
        if detail >= min_detail:
            best = Match(score, detail, flip)
    return best


def _align(g: Image.Image, ref: np.ndarray) -> tuple[float, tuple]:
    """(score, box): 1 = same pixels up to brightness / contrast: NCC of high-passed thumbnails,
    best box among the probes, then refined by coordinate search in 2% and 1% steps (boxes at
    least 80% of each side)."""
    return _search(lambda box: float((_highpass32(_box(g, box)) * ref).sum()), PROBES, (0.02, 0.01))


def _detail(g: Image.Image, box: tuple, ref: np.ndarray) -> float:
    """The detail score of ``ref`` (``_detail64`` of the training image) against ``box`` of ``g``,
    refined by 1% and 0.5% steps: at 64 px the 1% offsets :func:`_align` leaves cost the fine
    detail that a shrunken, re-encoded copy still shares with its original."""
    return _search(lambda b: float((_detail64(_box(g, b)) * ref).sum()), (box,), (0.01, 0.005))[0]


def _search(score: Callable[[tuple], float], starts, steps) -> tuple[float, tuple]:
    """Coordinate ascent over crop boxes from the best of ``starts``, in each of ``steps``."""
    best, box = max((score(b), b) for b in starts)
    for step in steps:
        improved = True
        while improved:
            improved = False
            for i in range(4):
                for delta in (-step, step):
                    nb = list(box)
                    nb[i] = min(1.0, max(0.0, nb[i] + delta))
                    if nb[2] - nb[0] < 0.8 or nb[3] - nb[1] < 0.8:
                        continue
                    s = score(tuple(nb))
                    if s > best + 1e-4:
                        best, box, improved = s, tuple(nb), True
    return best, box


# ------------------------------------------------------------------------------- hash lookup
class HashTable:
    """Multi-index hashing over 64-bit hashes: four 16-bit bands, each a bucket table (argsort +
    offsets). A query looks up, per band, its own band value and the 16 values one bit away, and
    keeps the stored hashes within ``max_bits`` of the query by a vectorised popcount. Every pair
    within 7 bits is found (one of the four bands then differs in at most one bit); pairs up to
    ``max_bits`` are found when one band differs in at most one bit, which for near copies the
    many probes of one image nearly always give (measured in tests/unit/test_audit.py)."""

    _FLIPS = np.array([0] + [1 << k for k in range(16)], dtype=np.int64)

    def __init__(self, hashes: np.ndarray):
        self.hashes = np.ascontiguousarray(hashes, dtype=np.uint64)
        self.bands = []
        for b in range(4):
            v = ((self.hashes >> np.uint64(16 * b)) & np.uint64(0xFFFF)).astype(np.int64)
            order = np.argsort(v, kind="stable").astype(np.int64)
            starts = np.searchsorted(v[order], np.arange(1 << 16 | 1))
            self.bands.append((order, starts))

    def query(self, queries: np.ndarray, max_bits: int, chunk: int = 4096):
        """(query index, stored index, distance) of every pair within ``max_bits``, each once."""
        q_all = np.ascontiguousarray(queries, dtype=np.uint64)
        out = []
        for s in range(0, len(q_all), chunk):
            q = q_all[s:s + chunk]
            qi_l, ti_l = [], []
            for b, (order, starts) in enumerate(self.bands):
                qb = ((q >> np.uint64(16 * b)) & np.uint64(0xFFFF)).astype(np.int64)
                probes = (qb[:, None] ^ self._FLIPS[None, :]).ravel()
                lo = starts[probes]
                cnt = starts[probes + 1] - lo
                total = int(cnt.sum())
                qi = np.repeat(np.arange(len(q)).repeat(len(self._FLIPS)), cnt)
                ti = order[np.repeat(lo - np.cumsum(cnt) + cnt, cnt) + np.arange(total)]
                d = np.bitwise_count(self.hashes[ti] ^ q[qi])
                keep = d <= max_bits
                qi_l.append(qi[keep])
                ti_l.append(ti[keep])
            qi, ti = np.concatenate(qi_l), np.concatenate(ti_l)
            pair = qi * len(self.hashes) + ti
            _, first = np.unique(pair, return_index=True)  # a pair may come up in several bands
            qi, ti = qi[first], ti[first]
            out.append((qi + s, ti, np.bitwise_count(self.hashes[ti] ^ q[qi]).astype(np.int64)))
        if not out:
            return (np.zeros(0, np.int64),) * 3
        return tuple(np.concatenate([o[k] for o in out]) for k in range(3))


# ------------------------------------------------------------------------ pre-training index
@dataclass
class TrainIndex:
    """The stored hashes of one shard set (one manifest), row per readable sample; ``skipped`` names
    every sample of the manifest that has no row, with why (``not_audited``)."""
    manifest: str
    job: str
    fingerprint: str
    names: list  # shard names, in manifest order
    keys: np.ndarray  # str
    shard: np.ndarray  # int32: row -> position in names
    pos: np.ndarray  # int32: index of the sample within its shard
    exact: np.ndarray  # uint64
    phash: np.ndarray  # uint64
    samples: int = 0  # the manifest's samples: what a whole audit covers
    skipped: list = field(default_factory=list)  # {"shard", "index", "key", "reason"} per sample without a row
    shardset: Optional[ShardSet] = field(default=None, repr=False)  # the manifest's shards, read for this run
    stored: Optional[str] = None  # where hashes.npz is; None: it could not be stored, kept for this run only

    def save(self, folder: Union[LocalFolder, S3Prefix]) -> str:
        """Store as ``hashes.npz`` in ``folder`` (a temp file renamed, or one upload: a reader never
        sees half of it); returns its path or URL."""
        meta = {"format": "vitscale-hashes", "version": INDEX_VERSION, "kind": HASH_KIND, "manifest": self.manifest,
                "job": self.job, "fingerprint": self.fingerprint, "samples": self.samples, "skipped": self.skipped}
        buf = io.BytesIO()
        np.savez(buf, meta=np.array(json.dumps(meta)), names=np.array(self.names, dtype=str),
                 keys=self.keys.astype(str), shard=self.shard, pos=self.pos, exact=self.exact, phash=self.phash)
        with folder.create(HASHES_NAME) as out:
            out.write(buf.getvalue())
            out.commit()
        return folder.url(HASHES_NAME)

    def not_audited(self) -> dict:
        """reason -> samples of the manifest without a row: ``corrupt_image``, ``image_too_large``,
        ``no_image`` (the sample's members), ``lost_in_shard`` (the tar ended or broke before them),
        ``missing_shard`` (no such file)."""
        out: dict = {}
        for s in self.skipped:
            out[s["reason"]] = out.get(s["reason"], 0) + 1
        return out

    def coverage(self, done: str, show: int = 5) -> str:
        """``68 of 72 samples <done>`` and, when some are missing, why and the first ``show`` of them
        (``shard:key``, or ``shard#index`` for a sample the tar never delivered)."""
        line = f"{len(self.keys)} of {self.samples} samples {done}"
        if not self.skipped:
            return line
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(self.not_audited().items()))
        names = [f"{s['shard']}:{s['key']}" if s["key"] else f"{s['shard']}#{s['index']}" for s in self.skipped]
        more = f", ... ({len(names) - show} more)" if len(names) > show else ""
        return f"{line}; {len(self.skipped)} not ({kinds}): {', '.join(names[:show])}{more}"

    @classmethod
    def load(cls, folder: Union[LocalFolder, S3Prefix], manifest: str,
             shardset: ShardSet) -> Optional["TrainIndex"]:
        """The index stored in ``folder`` (``manifest``'s, whose shards are ``shardset``), or None when
        there is none or it is of another kind or version (one without the skipped samples' names
        is rebuilt, not trusted to have covered the manifest)."""
        where = folder.url(HASHES_NAME)
        try:
            data = folder.read_bytes(HASHES_NAME)
            if data is None:
                return None
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("format") != "vitscale-hashes" or meta.get("kind") != HASH_KIND or \
                        meta.get("version") != INDEX_VERSION:
                    return None
                return cls(manifest, meta.get("job", ""), meta["fingerprint"],
                           [str(n) for n in z["names"]], z["keys"], z["shard"], z["pos"], z["exact"], z["phash"],
                           int(meta["samples"]), list(meta["skipped"]), shardset, where)
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
            why = f"unreadable hash index ({e}); rebuild it with vit-audit --index --force"
            raise DataError(f"{where}: {why}") from None


def manifest_url(spec) -> str:
    """A manifest's path or ``s3://`` URL, given it or the folder (prefix) that holds it."""
    text = str(spec)
    if is_s3(text):
        return text if text.endswith(".json") else f"{text.rstrip('/')}/{MANIFEST_NAME}"
    p = Path(text)
    return str(p / MANIFEST_NAME if p.is_dir() else p)


def _folder(manifest: str) -> Union[LocalFolder, S3Prefix]:
    """The folder or ``s3://`` prefix of a manifest: where its ``hashes.npz`` lives."""
    return open_place(manifest.rsplit("/", 1)[0] if is_s3(manifest) else Path(manifest).parent, "--shards")


def _hash_shard(shard) -> tuple:
    """Worker: (keys, positions, exact, phash, skipped) of one shard; ``skipped``: every sample the
    manifest lists in it that got no hash, with why (``TrainIndex.skipped``)."""
    keys, pos, exact, ph = [], [], [], []
    skipped, lost = [], []
    tally = Tally()
    for raw in read_shard(shard, tally):
        if raw.lost:
            lost.append(raw.index)
            continue
        try:
            img = load_rgb(open_image(raw.members, MAX_PIXELS))
        except BadSample as e:
            skipped.append({"shard": shard.name, "index": raw.index, "key": raw.key, "reason": e.kind})
            continue
        e, p = train_hashes(img)
        keys.append(raw.key)
        pos.append(raw.index)
        exact.append(e)
        ph.append(p)
    why = "missing_shard" if tally.counts.get("missing_shard") else "lost_in_shard"
    skipped += [{"shard": shard.name, "index": i, "key": "", "reason": why} for i in lost]
    return keys, pos, exact, ph, sorted(skipped, key=lambda s: s["index"])


def build_index(manifest, workers: int = 1, progress: bool = False, allow_remote: bool = False,
                option: str = "--shards") -> TrainIndex:
    """Decode every sample of the shard set once and hash it (``workers`` processes over shards).
    ``allow_remote``: the manifest may be an ``s3://`` URL; ``option``: what errors name."""
    mpath = manifest_url(manifest)
    shardset = resolve_shards(mpath, allow_remote=allow_remote, key=option)
    job = read_manifest(mpath, allow_remote=allow_remote, key=option).get("job", "")
    shards = list(shardset.shards)
    if workers > 1:
        import multiprocessing

        with multiprocessing.get_context().Pool(workers) as pool:
            parts = list(_progress(pool.imap(_hash_shard, shards), len(shards), progress, mpath))
    else:
        parts = list(_progress(map(_hash_shard, shards), len(shards), progress, mpath))
    n = [len(p[0]) for p in parts]
    return TrainIndex(
        mpath, job, shardset.fingerprint(), [s.name for s in shards],
        np.array([k for p in parts for k in p[0]], dtype=str),
        np.repeat(np.arange(len(shards), dtype=np.int32), n),
        np.array([i for p in parts for i in p[1]], dtype=np.int32),
        np.array([e for p in parts for e in p[2]], dtype=np.uint64),
        np.array([h for p in parts for h in p[3]], dtype=np.uint64),
        sum(s.samples for s in shards), [s for p in parts for s in p[4]], shardset)


def _progress(it, total, on, what):
    if not on:
        return it
    from tqdm import tqdm

    return tqdm(it, total=total, unit="shard", desc=f"hashing {what}")


def train_index(manifest, workers: int = 1, rebuild: bool = False, progress: bool = False,
                allow_remote: bool = False, option: str = "--shards") -> TrainIndex:
    """The shard set's index from ``hashes.npz`` beside its manifest (in its folder or ``s3://``
    prefix); built (and stored there, when the folder or prefix takes it) when missing, of another
    kind, or made for another shard list. ``allow_remote``: the manifest may be an ``s3://`` URL;
    ``option``: the command-line option errors name."""
    mpath = manifest_url(manifest)
    shardset = resolve_shards(mpath, allow_remote=allow_remote, key=option)
    folder = _folder(mpath)
    index = None if rebuild else TrainIndex.load(folder, mpath, shardset)
    if index is not None and index.fingerprint == shardset.fingerprint():
        return index
    index = build_index(mpath, workers, progress, allow_remote, option)
    try:
        index.stored = index.save(folder)
    except (OSError, RemoteShardError) as e:  # a read-only folder or prefix (a 403 from the store)
        where = folder.url(HASHES_NAME)
        why = (e.strerror if isinstance(e, OSError) else None) or str(e).removeprefix(f"{where}: ")
        print(f"vit-audit: note: cannot store {where} ({why}); the hashes are used for this run only",
              file=sys.stderr)
    return index
