"""The method of ``vit-audit``: find evaluation images that also appear in the pre-training shards.

    vit-audit --index /shards/in21k/manifest.json --workers 8      # once: hashes.npz beside it
    vit-audit --shards /shards/in21k/manifest.json --eval cifar100:/data/cifar-100-python \\
              --eval vtab1k:/data/vtab-1k --eval imagefolder:/data/pets --output audit/
    python -m pretrain.evaluation.audit ...                               # the same

Outputs in ``--output``: ``audit.json`` (counts per evaluation set and split; per shard set the
manifest's ``samples``, the ``images`` audited, and every sample that was not, counted by reason in
``not_audited`` and named in ``not_audited_samples``; the candidates whose training sample could not
be read again to confirm them, ``unconfirmed``; every confirmed pair ``{"eval", "split",
"eval_id", "train_key", "shard", "manifest", "distance", "score", "detail", "match", "mirrored"}``),
``closest_pairs.png`` (the closest pairs side by side, for a person to look at) and
``exclude.txt`` (the matched pre-training keys; ``vit-shards --exclude`` and
``data.exclude_keys`` honour it, format in ``exclude.py``).

How a pair is found:
1. Pre-training side, once per shard set (``--index``, or the first audit): every decoded image
   gets an exact hash (BLAKE2b of its decoded RGB pixels) and a 64-bit perceptual hash
   (``imagehash.phash``: DCT of a 32x32 grey thumbnail, 8x8 low frequencies against their median).
   Stored with the keys in ``hashes.npz`` beside the manifest, checked against the shard list.
2. Evaluation side: the same hashes of every image, plus perceptual hashes of ``PROBES`` crops
   of it (up to 10% of each side cut away) and ``MIRROR_PROBES`` of its mirror image, because a pHash moves by
   20-36 bits when a copy is cropped by 10% (~30 when it is flipped), but by at most ~12 from the
   nearest probe (calibration below).
3. Candidates: exact-hash equality, and pHash pairs within ``MAX_BITS`` bits of any probe, looked
   up by multi-index hashing (``HashTable``): four 16-bit bands, each probed at Hamming radius 1,
   then the full 64-bit distance is checked (popcount); timings for 1M stored hashes against 10k
   images in benchmarks/results/audit-lookup-cpu.md (``python benchmarks/audit_speed.py``).
4. Confirmation (reads only the candidates' samples from the shards): an exact pair needs equal
   pixels; a near pair needs ``score >= MIN_SCORE``: the normalised cross-correlation of
   high-passed 32x32 grey thumbnails (a thumbnail minus its Gaussian blur: brightness, contrast
   and smooth colour shifts drop out), maximised over crop boxes of the evaluation image (the
   probes, then a local search by 2% and 1% steps), and then ``detail >= MIN_DETAIL``: the same
   correlation of the matched box at 64x64, each high-pass divided by its local contrast so that
   every textured region weighs alike (the box refined by 1% and 0.5% steps). Mirrored matches
   pass the same two checks on the mirror image, and only where a mirror probe was itself a
   candidate (within ``MAX_BITS``), as a direct match needs a direct probe; ``mirrored`` in the
   pair says which matched, ``distance`` is that orientation's nearest probe.

Calibration (tests/unit/test_audit.py holds the same data): scikit-image's sample photos, their
quadrants and the demo shapes; copies re-encoded (JPEG q=60), resized (x0.5..x1.5), cropped
(random boxes, <= 10% of the area) and colour-jittered (brightness, contrast, saturation, hue), and
all four at once. Nearest-probe pHash distance of such copies: mean 3, 99th percentile 10, max 12
bits (a brick-wall texture; photos <= 10). Unrelated photos: min 12 bits. Score of copies: min
0.94; of unrelated pairs (652, each maximised over the same boxes): max 0.42. Hence
``MAX_BITS = 12`` (recall first; confirmation removes what it lets in) and ``MIN_SCORE = 0.7``.
With the mirror image searched too (the 48 quarter tiles of the 12 photos, every ordered pair):
tiles of different photos score at most 0.56 (mirrored; 0.44 direct), so the mirror search keeps a
0.14 margin below 0.7. Within one photo, a mirrored half of a symmetric scene reaches 0.95 (retina,
clock) and two tiles of a regular grid of objects 0.79 direct (coins): true look-alikes that only
the pHash distance kept apart.
The detail check: crops of one scene at other places (IoU < 0.5) are no copies, but
where the scene is mirror-symmetric (facades, faces, clocks; ``hard_set`` in tests/unit/test_audit.py)
a crop's mirror image scores 0.7-0.9 against the crop at the mirrored place: the symmetric
outlines carry the 32x32 correlation while the asymmetric texture around them disagrees. Detail of
copies: the photo tiles' transforms above (two seeds) and the 32 px shapes x4, 808: min 0.59 (a
flat clock render, all four transforms at once), 1st percentile 0.64; planted in ``hard_set``
scenes (six seeds of 30), 180: min 0.86. Of non-copies scoring >= 0.7: those scenes' crops, 93:
detail max 0.50; the photo tiles' in-photo look-alikes, 11: max 0.55 (retina), 3 >= 0.5. Hence
``MIN_DETAIL = 0.5`` (recall first: 0.09 under the lowest copy). On ``hard_set`` with 24 scenes
the audit without it reported 4 to 10 mirrored crops besides the 24 copies (precision 0.71-0.86,
four seeds), with it none.
Known gaps: an evaluation image that is a *crop of* a training image (the reverse direction) is
found only while the crop is small (~2%), vertical flips and rotations are not looked for, a
symmetric scene's mirrored half can still match its other half where both are near-featureless
(with 15% of texture instead of 23%, 24 of 188 such crops passed both checks) or nearly identical
(retina's halves), and copies of near-featureless images (flat colour, pure texture crops) may be
missed.

Layering: this is the data floor; it imports nothing of ``pretrain``. The ``vit-audit`` command
(``pretrain/evaluation/audit.py``) sits above the transfer suites and hands this module the
evaluation images as ``EvalImage`` items; ``shards`` sets are read here (``read_shards_eval``).
"""
from __future__ import annotations

import posixpath
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
from PIL import Image, ImageDraw

from data_pipeline.audit.index import (
    MAX_BITS,
    MAX_PIXELS,
    MIN_DETAIL,
    MIN_SCORE,
    N_PROBES,
    PROBES,
    HashTable,
    confirm,
    manifest_url,
    pixel_hash,
    probe_hashes,
)
from data_pipeline.errors import DataError
from data_pipeline.shards.decode import BadSample, load_rgb, open_image
from data_pipeline.shards.exclude import ExclusionWriter
from data_pipeline.shards.manifest import MANIFEST_NAME, read_manifest, resolve_shards
from data_pipeline.shards.reader import read_shard
from data_pipeline.storage.places import open_place
from data_pipeline.storage.urls import is_remote, is_s3, last_part
from data_pipeline.tally import Tally


# ----------------------------------------------------------------------- evaluation readers
@dataclass
class EvalImage:
    set: str  # "cifar100", "vtab1k/dtd", "imagefolder/pets", "shards/c100-test"
    split: str
    id: str  # path relative to the set's root, "split/index" (CIFAR-100) or the shard key
    load: Callable[[], Image.Image]


def _shard_split(mpath: str, set_name: str, split: Optional[str], allow_remote: bool) -> Iterator[EvalImage]:
    shardset = resolve_shards(mpath, allow_remote=allow_remote, key="--eval shards")
    split = split or read_manifest(mpath, allow_remote=allow_remote, key="--eval shards").get("split", "test")
    for shard in shardset.shards:
        for raw in read_shard(shard, Tally()):
            if raw.lost:  # an evaluation image not audited would pass for a clean one
                raise DataError(f"{shard.url}: sample #{raw.index} of the {shard.samples} {mpath} lists is "
                                "missing (a truncated or damaged tar); the evaluation set must be read whole")

            def load(members=raw.members, where=f"{shard.url}:{raw.key}"):
                try:
                    return load_rgb(open_image(members, MAX_PIXELS))
                except BadSample as e:
                    raise DataError(f"{where}: {e}") from None
            yield EvalImage(set_name, split, raw.key, load)


def read_shards_eval(path: str, allow_remote: bool = False) -> Iterator[EvalImage]:
    """``shards:PATH``: a manifest (or its folder or ``s3://`` prefix), or the shards suite's ROOT
    with train/ test/ [val/] each holding shards + manifest.json (in a store, each manifest is asked
    for by name). IDs are the samples' keys. ``allow_remote``: PATH may be an ``s3://`` URL."""
    if is_remote(path) and not is_s3(path):
        raise DataError(f"--eval shards:{path}: {path.split(':', 1)[0]}: URLs are not read here; give a folder, "
                        "a manifest.json or s3://bucket/prefix")
    if is_s3(path) and not allow_remote:
        raise DataError(f"--eval shards:{path}: reaching a store needs allow_remote")
    if (is_s3(path) and not path.endswith(".json")) or (not is_remote(path) and Path(path).is_dir()):
        root = open_place(path, "--eval shards")
        if root.stat(MANIFEST_NAME) is None:
            subs = [(s, open_place(root.url(s), "--eval shards")) for s in ("train", "val", "test")]
            found = [(s, sub) for s, sub in subs if sub.stat(MANIFEST_NAME) is not None]
            if not found:
                raise DataError(f"{path}: no {MANIFEST_NAME} here nor in train/ val/ test/ (--eval shards:PATH)")
            for s, sub in found:
                yield from _shard_split(sub.url(MANIFEST_NAME), f"shards/{last_part(path)}", s, allow_remote)
            return
    mpath = manifest_url(path)
    yield from _shard_split(mpath, f"shards/{last_part(posixpath.dirname(mpath))}", None, allow_remote)


# ------------------------------------------------------------------------------------ audit
@dataclass
class Pair:
    eval: str
    split: str
    eval_id: str
    train_key: str
    shard: str
    manifest: str
    distance: int  # pHash bits to the nearest probe of the matched orientation (0: exact pixel match)
    score: float  # confirmation score (1.0 for an exact pixel match)
    match: str  # "exact" or "near"
    mirrored: bool = False  # the training image is a horizontally flipped copy
    detail: float = 1.0  # the second confirmation score, of finer detail (1.0 for an exact pixel match)

    def as_json(self) -> dict:
        return {"eval": self.eval, "split": self.split, "eval_id": self.eval_id, "train_key": self.train_key,
                "shard": self.shard, "manifest": self.manifest, "distance": self.distance,
                "score": round(self.score, 4), "detail": round(self.detail, 4), "match": self.match,
                "mirrored": self.mirrored}


@dataclass
class AuditResult:
    pairs: list
    images: dict  # (set, split) -> evaluation images hashed
    candidates: int  # pairs sent to confirmation
    indexes: list
    seconds: dict = field(default_factory=dict)
    max_bits: int = MAX_BITS
    min_score: float = MIN_SCORE
    min_detail: float = MIN_DETAIL
    # candidates whose training sample could not be read again to confirm them (the shard changed
    # since it was hashed): {"manifest", "shard", "index", "key", "reason"}; none of them is a pair
    unconfirmed: list = field(default_factory=list)

    def counts(self) -> dict:
        out: dict = {}
        hit = defaultdict(set)
        kinds = defaultdict(lambda: {"exact": 0, "near": 0})
        for p in self.pairs:
            hit[(p.eval, p.split)].add(p.eval_id)
            kinds[(p.eval, p.split)][p.match] += 1
        for (s, split), n in self.images.items():
            out.setdefault(s, {})[split] = {"images": n, "contaminated": len(hit[(s, split)]),
                                            "exact_pairs": kinds[(s, split)]["exact"],
                                            "near_pairs": kinds[(s, split)]["near"]}
        return out


def check_thresholds(max_bits, min_score, min_detail=MIN_DETAIL) -> None:
    """A one-line DataError for a threshold no pair can meet or every pair meets (a pHash distance
    is 0..64 bits, a correlation score at most 1): such an audit would report a false clean."""
    if isinstance(max_bits, bool) or not isinstance(max_bits, (int, np.integer)) or not 0 <= max_bits <= 64:
        raise DataError(f"--max-bits {max_bits}: a pHash distance is 0..64 bits (default {MAX_BITS})")
    for option, v, default in (("--min-score", min_score, MIN_SCORE), ("min_detail", min_detail, MIN_DETAIL)):
        if not 0.0 <= v <= 1.0:  # NaN fails too
            raise DataError(f"{option} {v:g}: a correlation score is compared in [0, 1] (default {default:g})")


def audit(indexes: list, evals: Iterable[EvalImage], *, max_bits: int = MAX_BITS,
          min_score: float = MIN_SCORE, min_detail: float = MIN_DETAIL) -> AuditResult:
    """Every (evaluation image, pre-training sample) pair that is an exact or near copy. Thresholds
    out of range: ``check_thresholds``."""
    check_thresholds(max_bits, min_score, min_detail)
    t0 = time.perf_counter()
    images: list = []
    probes, exact = [], []
    counts: dict = defaultdict(int)
    for e in evals:
        img = e.load()
        images.append(e)
        counts[(e.set, e.split)] += 1
        exact.append(pixel_hash(img))
        probes.append(probe_hashes(img))
    t1 = time.perf_counter()
    P = N_PROBES
    Q = np.stack(probes).ravel() if probes else np.zeros(0, np.uint64)
    E = np.array(exact, dtype=np.uint64)
    # (index no, row) -> {eval no: [bits to the nearest direct probe, to the nearest mirror probe]}:
    # each orientation is confirmed only where its own probes came near (64: none did)
    cands: dict = {}
    for k, idx in enumerate(indexes):
        order = np.argsort(idx.exact, kind="stable")
        sorted_exact = idx.exact[order]
        lo, hi = np.searchsorted(sorted_exact, E, "left"), np.searchsorted(sorted_exact, E, "right")
        for j in np.flatnonzero(hi > lo):
            for row in order[lo[j]:hi[j]]:
                cands.setdefault((k, int(row)), {})[int(j)] = [0, 64]
        if len(idx.phash) and len(Q):
            qi, ti, d = HashTable(idx.phash).query(Q, max_bits)
            for q, side, row, bits in zip((qi // P).tolist(), (qi % P >= len(PROBES)).tolist(), ti.tolist(),
                                          d.tolist()):
                slot = cands.setdefault((k, row), {}).setdefault(q, [64, 64])
                slot[side] = min(bits, slot[side])
    t2 = time.perf_counter()
    pairs, unconfirmed = _confirm(indexes, images, exact, cands, max_bits, min_score, min_detail)
    pairs.sort(key=lambda p: (p.distance, -p.score, p.eval, p.eval_id, p.train_key))
    return AuditResult(pairs, dict(counts), sum(len(v) for v in cands.values()), indexes,
                       {"hash_eval": round(t1 - t0, 3), "lookup": round(t2 - t1, 3),
                        "confirm": round(time.perf_counter() - t2, 3)}, max_bits, min_score, min_detail,
                       unconfirmed)


def _confirm(indexes, images, exact, cands, max_bits, min_score, min_detail) -> tuple[list, list]:
    """Read each candidate training sample once (one pass per shard): (confirmed pairs, the
    candidates' samples that could not be read, as ``AuditResult.unconfirmed``)."""
    by_shard = defaultdict(list)
    for (k, row), evs in cands.items():
        by_shard[(k, int(indexes[k].shard[row]))].append((row, evs))
    eval_cache: dict = {}
    pairs, unread = [], []
    for (k, s), rows in sorted(by_shard.items()):
        idx = indexes[k]
        shard = next(sh for sh in idx.shardset.shards if sh.name == idx.names[s])
        want = {int(idx.pos[row]): (row, evs) for row, evs in rows}
        ranges = [(p, p + 1) for p in sorted(want)]
        tally = Tally()
        for raw in read_shard(shard, tally, ranges):
            if raw.index not in want:
                continue
            row, evs = want[raw.index]
            try:
                if raw.lost:
                    raise BadSample("missing_shard" if tally.counts.get("missing_shard") else "lost_in_shard")
                train_img = load_rgb(open_image(raw.members, MAX_PIXELS))
            except BadSample as e:
                unread.append({"manifest": idx.manifest, "shard": shard.name, "index": raw.index,
                               "key": str(idx.keys[row]), "reason": e.kind})
                continue
            train_exact = int(idx.exact[row])
            for j, bits in evs.items():
                if j not in eval_cache:
                    eval_cache[j] = images[j].load()
                ev_img = eval_cache[j]
                e = images[j]
                if exact[j] == train_exact and ev_img.size == train_img.size and \
                        ev_img.convert("RGB").tobytes() == train_img.tobytes():
                    pairs.append(Pair(e.set, e.split, e.id, raw.key, shard.name, idx.manifest, 0, 1.0, "exact"))
                    continue
                sides = tuple(flip for flip in (False, True) if bits[flip] <= max_bits)
                m = confirm(ev_img, train_img, min_score=min_score, min_detail=min_detail, mirrored=sides)
                if m is not None:
                    pairs.append(Pair(e.set, e.split, e.id, raw.key, shard.name, idx.manifest, int(bits[m.mirrored]),
                                      m.score, "near", m.mirrored, m.detail))
    return pairs, unread


# ----------------------------------------------------------------------------------- report
def write_report(result: AuditResult, out_dir, evals: list, *, grid: int = 24,
                 images: Optional[dict] = None) -> dict:
    """``audit.json``, ``exclude.txt`` and ``closest_pairs.png`` in ``out_dir``; returns the JSON."""
    from data_pipeline.files import write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": "vitscale-audit", "version": 2,
        "thresholds": {"max_bits": result.max_bits, "min_score": result.min_score,
                       "min_detail": result.min_detail, "probes": N_PROBES},
        "shards": [{"manifest": i.manifest, "job": i.job, "samples": i.samples, "images": int(len(i.keys)),
                    "not_audited": i.not_audited(), "not_audited_samples": i.skipped} for i in result.indexes],
        "evals": evals,
        "counts": result.counts(),
        "candidates": result.candidates,
        "unconfirmed": result.unconfirmed,
        "seconds": result.seconds,
        "pairs": [p.as_json() for p in result.pairs],
    }
    write_json(out / "audit.json", doc, indent=1)
    ex = ExclusionWriter()
    for i in result.indexes:
        ex.groups.setdefault((i.manifest, i.job), set())
    for p in result.pairs:
        job = next(i.job for i in result.indexes if i.manifest == p.manifest)
        ex.add(p.manifest, job, p.train_key)
    ex.write(out / "exclude.txt", "vit-audit exclusion list: pre-training keys whose image matches an "
                                  "evaluation image (audit.json has the pairs)")
    _grid(result, out / "closest_pairs.png", grid, images or {})
    return doc


def _grid(result: AuditResult, path: Path, n: int, loaders: dict) -> None:
    """The ``n`` closest pairs, evaluation image left, training image right, with a caption."""
    pairs = result.pairs[:n]
    T, cap = 112, 330
    canvas = Image.new("RGB", (2 * T + cap + 16, max(1, len(pairs)) * (T + 8) + 8), "white")
    draw = ImageDraw.Draw(canvas)
    if not pairs:
        draw.text((8, 8), f"{len(result.pairs)} pairs, none drawn (grid 0)" if result.pairs else "no pairs found",
                  fill="black")
    train = _train_images(result, pairs)
    for r, p in enumerate(pairs):
        y = 8 + r * (T + 8)
        pair = (loaders.get((p.eval, p.split, p.eval_id)), train.get((p.manifest, p.shard, p.train_key)))
        for c, img in enumerate(pair):
            if img is not None:
                img = img.convert("RGB")
                f = T / max(img.size)  # CIFAR's 32 px shown 3x, nearest: its pixels stay visible
                img = img.resize((max(1, int(img.width * f)), max(1, int(img.height * f))),
                                 Image.NEAREST if f > 1 else Image.BILINEAR)
                canvas.paste(img, (8 + c * (T + 4), y))
        text = (f"{p.eval} {p.split}\n{p.eval_id}\n-> {Path(p.manifest).parent.name}/{p.shard}\n"
                f"   key {p.train_key}\n{p.match}{' (mirrored)' if p.mirrored else ''}: {p.distance} bits, "
                f"score {p.score:.3f}, detail {p.detail:.3f}")
        draw.text((2 * T + 16, y), text, fill="black")
    canvas.save(path)


def _train_images(result: AuditResult, pairs: list) -> dict:
    want = defaultdict(set)
    for p in pairs:
        want[(p.manifest, p.shard)].add(p.train_key)
    shardsets = {i.manifest: i.shardset for i in result.indexes}
    out = {}
    for (manifest, shard_name), keys in want.items():
        shard = next(s for s in shardsets[manifest].shards if s.name == shard_name)
        for raw in read_shard(shard, Tally()):
            if raw.key in keys:
                try:
                    out[(manifest, shard_name, raw.key)] = load_rgb(open_image(raw.members, MAX_PIXELS))
                except BadSample:
                    pass
    return out




