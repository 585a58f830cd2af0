"""Shard read throughput per worker from an S3 API store against the same shards on local disk,
both measured in the same run:

  (fetch)  every shard object's bytes, whole, by each client: ours (``S3Object``: boto3 behind
           the retrying, resumable reader the loader uses), boto3's plain ``get_object().read()``
           and obstore (Rust, ``obstore.get(...).bytes()``); from disk ``open().read()``
  (raw)    the shard reader alone (``read_shard``: tar members, no image decode) over every shard
  (loader) the training loader (``build_loader``, one process, data.workers=0) at 224 with the
           pre-training transforms, one epoch

obstore is the peer a user would pick instead of boto3 (``pip install obstore``; not a dependency).

The store is ``moto_server`` on 127.0.0.1 (tests/s3_server.py; ``pip install -e .[test]``), the
shards are ``vit-shards --source demo`` written once to disk and once to ``s3://`` (the same bytes).
moto is a Python server, so the ratio is a floor for a real store on a fast network, not a
measurement of one; the point is what the S3 path (boto3, ranged GETs, the retry wrapper) costs a
worker beside a local read.

    python benchmarks/s3_read.py                       # 1024 demo images in shards of 128, 3 rounds
    python benchmarks/s3_read.py --images 4096 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from s3_server import MotoS3  # noqa: E402

from data_pipeline.config import DataConfig  # noqa: E402
from data_pipeline.loading.loader import build_loader  # noqa: E402
from data_pipeline.shards.manifest import resolve_shards  # noqa: E402
from data_pipeline.shards.reader import read_shard  # noqa: E402
from data_pipeline.shards.writer import write_demo_shards  # noqa: E402
from data_pipeline.tally import Tally  # noqa: E402


def fetch(read, shards: list[str]) -> tuple[float, int, int]:
    """(seconds, objects, bytes) to fetch every shard whole with ``read(url) -> bytes``."""
    t0, size = time.perf_counter(), 0
    for url in shards:
        size += len(read(url))
    return time.perf_counter() - t0, len(shards), size


def fetchers(env: dict) -> dict:
    """url -> bytes, per client."""
    import boto3
    import obstore
    from obstore.store import S3Store

    from data_pipeline.storage.retry import RemotePolicy
    from data_pipeline.storage.s3 import S3Object
    from data_pipeline.storage.urls import split_s3

    b3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_DEFAULT_REGION"],
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    stores: dict = {}

    def ob(url: str) -> bytes:
        bucket, key = split_s3(url)
        if bucket not in stores:
            stores[bucket] = S3Store(bucket, endpoint=env["AWS_ENDPOINT_URL"], region=env["AWS_DEFAULT_REGION"],
                                     access_key_id=env["AWS_ACCESS_KEY_ID"],
                                     secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                                     client_options={"allow_http": True})
        return obstore.get(stores[bucket], key).bytes().to_bytes()

    def ours(url: str) -> bytes:
        with S3Object(url, url.rsplit("/", 1)[1], RemotePolicy()) as f:
            return f.read()

    return {"ours": ours,
            "boto3": lambda url: b3.get_object(Bucket=split_s3(url)[0], Key=split_s3(url)[1])["Body"].read(),
            "obstore": ob}


def raw_read(spec: str) -> tuple[float, int, int]:
    """(seconds, samples, bytes) to read every member of every shard."""
    shardset = resolve_shards(spec, allow_remote=True)
    t0, n, size = time.perf_counter(), 0, 0
    for shard in shardset.shards:
        for sample in read_shard(shard, Tally()):
            n += 1
            size += sum(len(v) for v in sample.members.values())
    return time.perf_counter() - t0, n, size


def loader_epoch(spec: str, batch: int) -> tuple[float, int]:
    loader = build_loader(DataConfig(train_shards=spec, allow_remote=True, workers=0, shuffle_buffer=256),
                          batch_size=batch, seed=0, img_size=224)
    t0, n = time.perf_counter(), 0
    for x, _ in loader:
        n += len(x)
        if loader.epoch == 1:
            break
    return time.perf_counter() - t0, n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--shard-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="best of N for each reading")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, MotoS3() as store:
        os.environ.update(store.env)
        store.client().create_bucket(Bucket="bench")
        local, url = Path(tmp) / "train", "s3://bench/demo/train"
        for out in (local, url):
            write_demo_shards(out, n=args.images, shard_size=args.shard_size)
        mib = sum(f.stat().st_size for f in local.glob("*.tar")) / 2 ** 20
        print(f"{args.images} demo images in {len(list(local.glob('*.tar')))} shards, {mib:.1f} MiB; "
              f"best of {args.rounds} rounds, one process")
        names = sorted(f.name for f in local.glob("*.tar"))
        best = {}
        clients = {"disk": lambda u: Path(u).read_bytes(), **fetchers(store.env)}
        for _ in range(args.rounds):
            for who, read in clients.items():
                r = fetch(read, [str(local / n) if who == "disk" else f"{url}/{n}" for n in names])
                if who not in best or r[0] < best[who][0]:
                    best[who] = r
        for who, (t, n, size) in best.items():
            print(f"fetch   {who:8s} {size / 2 ** 20 / t:7.1f} MiB/s  {n / t:6.1f} objects/s"
                  + ("" if who == "disk" else f"   vs ours {best['ours'][0] / t:.2f}x"))
        for what, fn in (("raw", raw_read), ("loader", lambda s: loader_epoch(s, args.batch))):
            best = {}
            for _ in range(args.rounds):
                for where, spec in (("disk", str(local)), ("s3", url)):
                    r = fn(spec)
                    if where not in best or r[0] < best[where][0]:
                        best[where] = r
            rate = {w: best[w][1] / best[w][0] for w in best}
            mibs = {w: f"{best[w][2] / 2 ** 20 / best[w][0]:.0f} MiB/s" if len(best[w]) > 2 else "" for w in best}
            print(f"{what:7s} disk {rate['disk']:7.0f} img/s {mibs['disk']:>9s}   s3 (moto) {rate['s3']:7.0f} img/s "
                  f"{mibs['s3']:>9s}   s3/disk {rate['s3'] / rate['disk']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
