"""Contamination audit lookup speed: 1,000,000 stored pre-training hashes against
10,000 evaluation images, one core, target under 10 s.

What is timed is what ``data_pipeline.audit.match.audit`` does between hashing the evaluation images
and confirming candidates: building the multi-index table over the stored 64-bit pHashes
(``HashTable``), looking up every probe of every evaluation image (29 per image, 22 crops of it
and 7 of its mirror image: 290,000 queries) within ``MAX_BITS``, and the exact-hash join
(sort + searchsorted). Hashes are synthetic
(uniform 64-bit); ``--planted`` evaluation images get a stored neighbour at 1..7 bits (which the
table guarantees to find) and are counted. Hashing itself is measured separately on real
images: pHash of an evaluation image's 29 probes, and exact + pHash of a stored image (the
one-off ``vit-audit --index`` pass, per core).

    .venv/bin/python benchmarks/audit_speed.py            # about 10-15 s on 2 vCPU
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from data_pipeline.audit.index import MAX_BITS, N_PROBES, HashTable, probe_hashes, train_hashes  # noqa: E402


def lookup(stored: int, evals: int, planted: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ph = rng.integers(0, 2**63, stored, dtype=np.int64).astype(np.uint64) ^ \
        (rng.integers(0, 2, stored).astype(np.uint64) << np.uint64(63))
    exact = rng.integers(0, 2**63, stored, dtype=np.int64).astype(np.uint64)
    P = N_PROBES
    q = rng.integers(0, 2**63, evals * P, dtype=np.int64).astype(np.uint64)
    q_exact = rng.integers(0, 2**63, evals, dtype=np.int64).astype(np.uint64)
    rows = rng.choice(stored, planted, replace=False)
    for j, row in enumerate(rows):  # probe 0 of eval image j sits 1..7 bits from stored row
        bits = rng.choice(64, size=1 + j % 7, replace=False)
        q[j * P] = ph[row] ^ np.uint64(sum(1 << int(b) for b in bits))
    q_exact[:planted // 2] = exact[rows[:planted // 2]]

    t0 = time.perf_counter()
    table = HashTable(ph)
    t1 = time.perf_counter()
    qi, ti, d = table.query(q, MAX_BITS)
    t2 = time.perf_counter()
    order = np.argsort(exact, kind="stable")
    se = exact[order]
    lo, hi = np.searchsorted(se, q_exact, "left"), np.searchsorted(se, q_exact, "right")
    t3 = time.perf_counter()
    found = {(int(a) // P, int(b)) for a, b in zip(qi, ti)}
    hits = sum((j, int(r)) in found for j, r in enumerate(rows))
    return {"build": t1 - t0, "query": t2 - t1, "exact": t3 - t2, "total": t3 - t0, "pairs": len(found),
            "planted_found": hits, "exact_found": int((hi > lo).sum()), "queries": len(q)}


def hashing(n: int = 40) -> dict:
    from PIL import Image

    from data_pipeline.shards.demo_data import demo_items

    _, items = demo_items("train", n, seed=1)
    imgs = [it.load().convert("RGB").resize((256, 256)) for it in items]
    t0 = time.perf_counter()
    for im in imgs:
        probe_hashes(im)
    t1 = time.perf_counter()
    for im in imgs:
        train_hashes(im)
    t2 = time.perf_counter()
    return {"eval_ms": 1e3 * (t1 - t0) / n, "train_ms": 1e3 * (t2 - t1) / n, "size": imgs[0].size,
            "mode": Image.Image.__name__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stored", type=int, default=1_000_000)
    ap.add_argument("--evals", type=int, default=10_000)
    ap.add_argument("--planted", type=int, default=1_000)
    args = ap.parse_args()
    r = lookup(args.stored, args.evals, args.planted)
    print(f"stored {args.stored:,} hashes, {args.evals:,} evaluation images x {N_PROBES} probes "
          f"= {r['queries']:,} queries, max {MAX_BITS} bits, one core")
    print(f"  build table {r['build']:.2f} s, pHash lookup {r['query']:.2f} s, exact join {r['exact']:.3f} s"
          f" -> total {r['total']:.2f} s (target < 10 s: {'met' if r['total'] < 10 else 'NOT met'})")
    print(f"  planted neighbours (1..7 bits) found: {r['planted_found']}/{args.planted}; exact planted found: "
          f"{r['exact_found']}/{args.planted // 2}; candidate pairs in all: {r['pairs']:,}")
    h = hashing()
    print(f"  hashing (256x256 px): evaluation image {h['eval_ms']:.1f} ms ({N_PROBES} probes), "
          f"stored image {h['train_ms']:.2f} ms (exact + pHash, decode not included)")
    return 0 if r["total"] < 10 and r["planted_found"] == args.planted else 1


if __name__ == "__main__":
    sys.exit(main())
