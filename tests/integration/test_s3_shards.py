"""Shards in an S3 API store (``s3://bucket/prefix``), against a real server: ``moto_server`` in its
own process with IAM authentication on (tests/s3_server.py), behind a TCP proxy that cuts
connections, refuses new ones and answers ``503 SlowDown``. ``vit-shards --output s3://...`` writes
what it writes to disk, byte for byte; the loader reads the same samples from the store as from
disk, through cuts and SlowDown bursts (resumed at the byte, retries counted) and through an outage
until it has lasted data.remote_retry_s, said when it starts and ends; past that bound the store is
unreachable (exit 69); a missing key, a missing bucket and wrong credentials are one line;
``vit-launch check`` checks the shards in the store as on disk; an interrupted write is finished by
a rerun that keeps the complete shards and aborts unfinished uploads on every LIST page;
``--part I/N`` + ``vit-shards merge`` work on a prefix; an output URL nobody writes is one line and
no local folder; ``vit-transfer --suite shards`` and ``vit-audit`` give from the store the numbers
and pairs they give from disk; 2 ranks train from the store through a cut and a kill -9 + resume on
exactly the samples they read from disk; a run rides out a 45 s stop of the store, and one whose
store is gone for good ends with exit 69 and is restarted by ``vit-launch --max-restarts`` once the
store is back, on those same samples."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import time

import pytest
import torch
from dist_utils import TINY_CONFIG, kill_group, metrics, reaped, run_job, wait_for
from s3_server import UPLOADS_PAGE, MotoS3, Proxy
from shard_utils import InterruptOnce, one_epoch, remote_data_cfg

from data_pipeline.errors import DataError
from data_pipeline.loading.loader import build_loader
from data_pipeline.shards import cli, sources
from data_pipeline.shards.demo_data import demo_items
from data_pipeline.shards.manifest import resolve_shards
from data_pipeline.shards.writer import PROGRESS_NAME, write_shards
from data_pipeline.storage.retry import StoreUnreachable
from data_pipeline.storage.s3 import S3Prefix

BUCKET = "vitscale-test"
DEMO = ["--source", "demo", "--limit", "96", "--shard-size", "12", "--quiet"]


def _cfg(shards: str, **kw):
    return remote_data_cfg(shards, **kw)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """moto_server + the proxy, the bucket, and this process's (and its jobs') AWS_* variables
    pointing at the proxy; all restored and stopped (by PID) at the module's end, so no later test
    file of this worker runs with them."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = MotoS3(log).start()
    proxy = Proxy(server.port).start()
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for k in saved:
        del os.environ[k]
    os.environ.update({**server.env, "AWS_ENDPOINT_URL": proxy.url})
    server.client().create_bucket(Bucket=BUCKET)
    try:
        yield type("Store", (), {"server": server, "proxy": proxy, "client": server.client()})
    finally:
        proxy.stop()
        server.stop()
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[k]
        os.environ.update(saved)


@pytest.fixture
def proxy(store):
    store.proxy.reset()
    yield store.proxy
    store.proxy.reset()


@pytest.fixture(scope="module")
def written(store, tmp_path_factory):
    """The same demo shards written by ``python -m data_pipeline.write_shards`` to disk and to the store."""
    local = tmp_path_factory.mktemp("s3local") / "train"
    url = f"s3://{BUCKET}/demo/train"
    for out in (str(local), url):
        r = run_job([sys.executable, "-m", "data_pipeline.write_shards", *DEMO, "--output", out], timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip().endswith(f"96 samples in 8 shards, 10 classes -> {out}/manifest.json"), r.stdout
    return local, url




@pytest.fixture(scope="module")
def from_disk(written):
    batches, counters = one_epoch(_cfg(str(written[0])))
    assert counters == {"samples": 96} and len(batches) == 12
    return batches


def _same(a, b):
    assert [k for k, _, _ in a] == [k for k, _, _ in b]
    for (_, ya, xa), (_, yb, xb) in zip(a, b):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def _objects(client, prefix: str) -> dict:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"][len(prefix):]: o["Size"] for p in pages for o in p.get("Contents", [])}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("url", ["gs://bucket/shards", "foo://x"])
def test_output_url_nobody_writes_is_one_line_and_no_folder(url, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main([*DEMO, "--output", url])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    scheme = url.split(":")[0]
    assert err.startswith(f"vit-shards: error: --output {url}: cannot write to {scheme}: URLs"), err
    assert list(tmp_path.iterdir()) == []  # no folder named "gs:" or "foo:"


def test_written_to_the_store_byte_for_byte_and_read_back_as_from_disk(store, written, from_disk, proxy, capsys):
    local, url = written
    objects = _objects(store.client, "demo/train/")
    assert sorted(objects) == sorted(p.name for p in local.iterdir())  # no progress file, no leftovers
    for name in objects:
        body = store.client.get_object(Bucket=BUCKET, Key=f"demo/train/{name}")["Body"].read()
        assert _sha(body) == _sha((local / name).read_bytes()), name
    assert not store.client.list_multipart_uploads(Bucket=BUCKET).get("Uploads")

    halves = [f"{url}/train-{{000000..000003}}.tar", f"{url}/train-00000{{4..7}}.tar"]  # a list of patterns
    for spec in (url, f"{url}/manifest.json", f"{url}/", halves):
        batches, counters = one_epoch(_cfg(spec))
        _same(batches, from_disk)
        assert counters == {"samples": 96}
    picked = resolve_shards(f"{url}/train-{{000002..000004}}.tar", allow_remote=True)
    assert [s.url for s in picked.shards] == [f"{url}/train-00000{i}.tar" for i in (2, 3, 4)]
    assert [s.index for s in picked.shards] == [2, 3, 4]
    with pytest.raises(DataError, match="needs data.allow_remote=true"):
        resolve_shards(url)
    from data_pipeline.loading.plan import main as plan

    lines = []
    for spec, flag in ((str(local), []), (url, ["--allow-remote"])):  # python -m data_pipeline.loading.plan
        plan([spec, "--world-size", "2", "--workers", "2", "--batch", "4", *flag])
        lines.append(capsys.readouterr().out.strip().rsplit("; planned in", 1)[0])
    assert lines[0] == lines[1] and lines[0].startswith("96 samples in 8 shards on 2 rank(s) x 2 worker(s)"), lines
    assert proxy.log == []


def test_read_through_two_cuts_and_a_slowdown_burst(store, written, from_disk, proxy):
    """In a dataloader worker: two connection cuts mid-shard (the second refusing connections for 1 s)
    and three 503 SlowDown answers: every sample once, in order, bit for bit; the retries counted."""
    total = sum(_objects(store.client, "demo/train/").values())
    proxy.plan([(total // 4, 0.0, 0), (total // 4, 1.0, 0), (total // 4, 0.0, 3)])
    batches, counters = one_epoch(_cfg(written[1], workers=1))
    _same(batches, from_disk)
    assert proxy.events == [] and proxy.log.count("cut") == 3 and proxy.log.count("slowdown") == 3, proxy.log
    # each failure retried: cut 1 (1), cut 2 then refused for 1 s (>= 3: 0.25 + 0.5 s of backoff < 1 s),
    # cut 3 (1) then 3 SlowDowns (3)
    assert counters["remote_retries"] >= 8, counters
    assert set(counters) == {"samples", "remote_retries"}, counters


def test_an_outage_is_retried_until_it_has_lasted_remote_retry_s(store, written, from_disk, proxy, capsys):
    """The store cut mid-shard and stopped for 4.5 s, data.remote_retry_s=6: ridden out (a count of
    failures, 8 by default, once ended such an outage at 3.75 s of backoff), every sample once, a
    line when the outage starts and one when it ends."""
    total = sum(_objects(store.client, "demo/train/").values())
    proxy.plan([(total // 3, 4.5, 0)])
    batches, counters = one_epoch(_cfg(written[1], remote_retry_s=6.0))
    _same(batches, from_disk)
    assert counters["remote_retries"] >= 5 and set(counters) == {"samples", "remote_retries"}, counters
    err = capsys.readouterr().err.splitlines()
    start = [x for x in err if "unreachable (" in x]
    end = [x for x in err if "reachable again after" in x]
    assert len(start) == len(end) == 1, err
    assert start[0].startswith(f"{written[1]}/train-") and "for up to 6 s (data.remote_retry_s)" in start[0], start
    lasted, retries = float(end[0].split("after ")[1].split(" s")[0]), int(end[0].split(" and ")[1].split()[0])
    assert 4.0 <= lasted <= 6.5 and retries == counters["remote_retries"], (end, counters)


def test_store_gone_for_good_ends_within_the_bound(store, written, proxy, capsys):
    proxy.plan([(10_000, 60.0, 0)])  # cut mid-shard, then refused (the fixture reopens the port)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable) as e:  # not a DataError: an outage, exit 69, restarted or requeued
        one_epoch(_cfg(written[1], remote_retry_s=2.0))
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{written[1]}/train-") and "server unreachable" in msg, msg
    assert "data.remote_retry_s=2" in msg and not isinstance(e.value, DataError), msg
    assert 2.0 <= took < 2.0 + 5.0, took
    assert "retrying" in capsys.readouterr().err


def test_missing_key_bucket_and_wrong_credentials_are_one_line(store, written, monkeypatch, capsys):
    c = store.client
    for name in _objects(c, "demo/train/"):
        if name != "train-000005.tar":
            c.copy_object(Bucket=BUCKET, Key=f"partial/{name}",
                          CopySource={"Bucket": BUCKET, "Key": f"demo/train/{name}"})
    url = f"s3://{BUCKET}/partial"
    with pytest.raises(DataError) as e:
        one_epoch(_cfg(url))
    assert str(e.value) == (f"{url}/train-000005.tar: S3 404 NoSuchKey: shard train-000005.tar is listed in the "
                            "manifest but not in the bucket"), e.value
    with pytest.raises(DataError) as e:
        build_loader(_cfg(f"s3://{BUCKET}/nope"), batch_size=8)
    assert str(e.value) == (f"s3://{BUCKET}/nope/manifest.json: S3 404 NoSuchKey: no such object in the bucket "
                            "(data.train_shards)"), e.value
    with pytest.raises(DataError) as e:
        build_loader(_cfg("s3://no-such-bucket/train"), batch_size=8)
    assert "S3 404 NoSuchBucket: bucket 'no-such-bucket' does not exist at this endpoint" in str(e.value)
    with pytest.raises(SystemExit):
        cli.main([*DEMO, "--output", "s3://no-such-bucket/train"])
    assert capsys.readouterr().err == ("vit-shards: error: s3://no-such-bucket/train: S3 404: bucket 'no-such-bucket' "
                                       "does not exist at this endpoint; check the URL and AWS_ENDPOINT_URL / "
                                       "AWS_ENDPOINT_URL_S3\n")

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(DataError) as e:
        build_loader(_cfg(written[1]), batch_size=8)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{written[1]}/manifest.json: S3 403 SignatureDoesNotMatch: "
                                              "check the credentials (AWS_ACCESS_KEY_ID"), msg
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODY")
    with pytest.raises(SystemExit) as e:
        cli.main([*DEMO, "--output", f"s3://{BUCKET}/denied"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"vit-shards: error: s3://{BUCKET}/denied: S3 403: check the credentials "
                                         "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                                         "~/.aws/credentials) and that they may access this bucket\n"), err
    assert not _objects(c, "denied/")




@pytest.mark.parametrize("variable,value,says", [
    ("AWS_ENDPOINT_URL", "127.0.0.1:9", "S3: endpoint AWS_ENDPOINT_URL='127.0.0.1:9' is not a URL; give it as "
                                        "http(s)://host[:port]"),
    ("AWS_PROFILE", "nosuchprofile", "S3: AWS_PROFILE='nosuchprofile' names no profile in "),
    ("AWS_DEFAULT_REGION", "us east 1", "S3: region AWS_DEFAULT_REGION='us east 1' is not a region name"),
], ids=["endpoint", "profile", "region"])
def test_client_settings_mistakes_are_one_line_naming_the_variable(store, written, monkeypatch, capsys, tmp_path,
                                                                   variable, value, says):
    """A setting boto3 cannot make a client with is one line naming the variable, where the store's
    manifest is read, where its shards are read (never counted as missing shards) and for vit-shards."""
    from data_pipeline.loading.loader import plan_loader

    cfg = _cfg(written[1])
    plan = plan_loader(cfg, batch_size=8, seed=3)  # the manifest, read with working settings
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))  # no profile of the user's own
    monkeypatch.setenv(variable, value)
    with pytest.raises(DataError) as e:
        build_loader(cfg, batch_size=8)
    assert str(e.value).startswith(says) and str(e.value).endswith("(data.train_shards)"), e.value
    with pytest.raises(DataError) as e:
        for _ in build_loader(cfg, batch_size=8, seed=3, img_size=16, plan=plan):
            pass
    assert "\n" not in str(e.value) and str(e.value).startswith(says), e.value
    with pytest.raises(SystemExit) as e:
        cli.main([*DEMO, "--output", f"s3://{BUCKET}/settings"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"vit-shards: error: {says}") and err.count("\n") == 1, err


def test_untrusted_tls_certificate_of_the_endpoint_is_one_line_not_an_outage(store, monkeypatch, capsys, tmp_path):
    from tls_server import UntrustedTLS

    with UntrustedTLS(tmp_path) as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        t0 = time.monotonic()
        with pytest.raises(DataError) as e:
            build_loader(_cfg(f"s3://{BUCKET}/demo/train"), batch_size=8)
        with pytest.raises(SystemExit) as end:
            cli.main([*DEMO, "--output", f"s3://{BUCKET}/tls"])
        assert time.monotonic() - t0 < 4.0
    msg = str(e.value)
    assert msg == (f"s3://{BUCKET}/demo/train/manifest.json: the endpoint's TLS certificate is not trusted; put the "
                   "CA that signed it in AWS_CA_BUNDLE, or check AWS_ENDPOINT_URL (data.train_shards)"), msg
    err = capsys.readouterr().err
    assert end.value.code == 2 and err.startswith(f"vit-shards: error: s3://{BUCKET}/tls: the endpoint's TLS "
                                                  "certificate is not trusted"), err


def test_preflight_checks_the_shards_in_the_store(store, written, tmp_path, capsys, monkeypatch):
    """``vit-launch check`` on s3:// shards: sizes by listing, tar headers by ranged GETs, as on disk;
    a missing shard, a short one, a non-tar and refused credentials each fail in one line."""
    from launch.cli import main

    c = store.client
    for name in _objects(c, "demo/train/"):
        c.copy_object(Bucket=BUCKET, Key=f"checked/{name}", CopySource={"Bucket": BUCKET, "Key": f"demo/train/{name}"})
    url = f"s3://{BUCKET}/checked"

    def check():
        with pytest.raises(SystemExit) as e:
            main(["check", "--config", "configs/tiny_cpu.yaml", f"data.train_shards={url}/manifest.json",
                  "data.allow_remote=true", "data.remote_retry_s=2", f"train.output_dir={tmp_path / 'run'}",
                  "model.num_classes=10", "train.micro_batch_size=4", "train.global_batch_size=8",
                  "data.workers=1", "--world-size", "2"])
        out, err = capsys.readouterr()
        return e.value.code, out, [x for x in err.splitlines() if x.startswith("vit-launch: error:")]

    code, out, errors = check()
    assert code == 0 and errors == [], (out, errors)
    assert "8 shard(s) in the store with the recorded sizes; tar headers read in 8" in out, out
    assert "not checked" not in out

    tar = c.get_object(Bucket=BUCKET, Key="checked/train-000003.tar")["Body"].read()
    c.put_object(Bucket=BUCKET, Key="checked/train-000003.tar", Body=tar[:-1024])
    code, out, errors = check()
    assert code == 2 and len(errors) == 1, (out, errors)
    assert errors[0] == (f"vit-launch: error: manifest: 1 of 8 shard(s) in the store do not match {url}/manifest.json, "
                         f"first {url}/train-000003.tar: {len(tar) - 1024} bytes, the manifest says {len(tar)}; "
                         "re-write them with vit-shards"), errors[0]
    c.put_object(Bucket=BUCKET, Key="checked/train-000003.tar", Body=b"x" * len(tar))  # right size, not a tar
    assert check()[2][0].endswith(f"first {url}/train-000003.tar: does not start with a tar header; "
                                  "re-write them with vit-shards")
    c.delete_object(Bucket=BUCKET, Key="checked/train-000003.tar")
    assert check()[2][0].endswith(f"first {url}/train-000003.tar: missing; re-write them with vit-shards")

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    code, out, errors = check()
    assert code == 2 and len(errors) == 1 and "S3 403" in errors[0] and "check the credentials" in errors[0], errors


def test_interrupted_write_to_the_store_is_finished_by_a_rerun(store, tmp_path, monkeypatch):
    classes, items = demo_items("val", 40)
    ref = tmp_path / "ref"
    write_shards(sources.Source("demo:val", classes, items), ref, split="val", shard_size=8, progress=False)
    order = list(range(40))
    random.Random(0).shuffle(order)
    wrapped = list(items)
    wrapped[order[21]] = InterruptOnce(items[order[21]])  # the 22nd sample written: shard 2 is half done
    src = sources.Source("demo:val", classes, wrapped)
    url, c = f"s3://{BUCKET}/rerun/val", store.client
    monkeypatch.setattr("data_pipeline.storage.s3.PART_BYTES", 20_000)  # multipart uploads of several parts
    with pytest.raises(KeyboardInterrupt):
        write_shards(src, url, split="val", shard_size=8, progress=False)
    assert sorted(_objects(c, "rerun/val/")) == [PROGRESS_NAME, "val-000000.tar", "val-000001.tar"]
    progress = json.loads(c.get_object(Bucket=BUCKET, Key=f"rerun/val/{PROGRESS_NAME}")["Body"].read())
    assert [s["etag"] for s in progress["shards"]] == [
        c.head_object(Bucket=BUCKET, Key=f"rerun/val/val-00000{i}.tar")["ETag"] for i in (0, 1)]
    for s in progress["shards"]:  # multipart ETags: "<md5 of the parts' md5s>-<parts>"
        assert s["etag"].endswith(f'-{-(-s["bytes"] // 20_000)}"'), s
    assert not c.list_multipart_uploads(Bucket=BUCKET, Prefix="rerun/").get("Uploads")  # aborted
    c.create_multipart_upload(Bucket=BUCKET, Key="rerun/val/val-000002.tar")  # as a kill -9 would leave

    created = []
    real_create = S3Prefix.create
    monkeypatch.setattr(S3Prefix, "create", lambda self, name: created.append(name) or real_create(self, name))
    m = write_shards(src, url, split="val", shard_size=8, progress=False)
    assert created == ["val-000002.tar", "val-000003.tar", "val-000004.tar"]  # complete shards kept
    assert m == json.loads((ref / "manifest.json").read_text())
    for s in m["shards"]:
        body = c.get_object(Bucket=BUCKET, Key=f"rerun/val/{s['name']}")["Body"].read()
        assert body == (ref / s["name"]).read_bytes()
    assert sorted(_objects(c, "rerun/val/")) == sorted(p.name for p in ref.iterdir())
    assert not c.list_multipart_uploads(Bucket=BUCKET, Prefix="rerun/").get("Uploads")
    created.clear()
    assert write_shards(src, url, split="val", shard_size=8, progress=False) == m and created == []

    c.put_object(Bucket=BUCKET, Key="rerun/val/val-000001.tar", Body=b"replaced by someone else")
    c.put_object(Bucket=BUCKET, Key=f"rerun/val/{PROGRESS_NAME}", Body=json.dumps(progress).encode())
    c.delete_object(Bucket=BUCKET, Key="rerun/val/manifest.json")
    write_shards(src, url, split="val", shard_size=8, progress=False)
    assert created[0] == "val-000001.tar"  # a shard whose size or ETag changed is written again


def test_unfinished_uploads_past_the_first_list_page_are_aborted(store):
    """Killed runs can leave more unfinished multipart uploads than one LIST answer holds (S3: 1,000
    a page; the test server: UPLOADS_PAGE): a rerun aborts every one of its own, on every page
    (two of a name: a page may end inside a key), and keeps another job's."""
    c, prefix = store.client, "unfinished/train/"
    own = [f"train-{i:06d}.tar" for i in range(3 * UPLOADS_PAGE + 1)]
    for name in own + own[:2]:
        c.create_multipart_upload(Bucket=BUCKET, Key=prefix + name)
    other = c.create_multipart_upload(Bucket=BUCKET, Key=prefix + "val-000000.tar")["UploadId"]
    try:
        first = c.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
        assert first["IsTruncated"] and len(first["Uploads"]) == UPLOADS_PAGE, first  # the server pages
        S3Prefix(f"s3://{BUCKET}/unfinished/train").clean_unfinished(re.compile(r"train-\d+\.tar"))
        pages = c.get_paginator("list_multipart_uploads").paginate(Bucket=BUCKET, Prefix=prefix)
        left = [(u["Key"], u["UploadId"]) for p in pages for u in p.get("Uploads", [])]
        assert left == [(prefix + "val-000000.tar", other)], left
    finally:
        pages = c.get_paginator("list_multipart_uploads").paginate(Bucket=BUCKET, Prefix=prefix)
        for u in [u for p in pages for u in p.get("Uploads", [])]:
            c.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])


def test_parts_and_merge_on_a_prefix(store, written, from_disk, capsys):
    url = f"s3://{BUCKET}/parts/train"
    for i in (2, 1):
        assert cli.main([*DEMO, "--output", url, "--part", f"{i}/2"]) == 0
    assert cli.main(["merge", url, f"{url}/part-*of0002.json"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"-> {url}/manifest.json")
    batches, counters = one_epoch(_cfg(url))
    assert sorted(k for b, _, _ in batches for k in b) == sorted(k for b, _, _ in from_disk for k in b)
    merged = json.loads(store.client.get_object(Bucket=BUCKET, Key="parts/train/manifest.json")["Body"].read())
    assert merged["total"] == 96 and merged["parts"] == 2
    with pytest.raises(SystemExit):
        cli.main(["merge", url, f"{url}/part-0003of0003.json"])
    assert "part-0003of0003.json: part manifest not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def suite(store, written, tmp_path_factory):
    """The shards suite's ROOT on disk and in the store (objects with the files' bytes): train/ (the
    written demo shards), test/ (40 other demo images), val/ (a copy of test/)."""
    disk = tmp_path_factory.mktemp("suite") / "suite"
    classes, items = demo_items("val", 40)
    write_shards(sources.Source("demo:val", classes, items), disk / "test", split="test", shard_size=20,
                 progress=False)
    shutil.copytree(written[0], disk / "train")
    shutil.copytree(disk / "test", disk / "val")
    for split in ("train", "test", "val"):
        for f in (disk / split).iterdir():
            store.client.put_object(Bucket=BUCKET, Key=f"suite/{split}/{f.name}", Body=f.read_bytes())
    return disk, f"s3://{BUCKET}/suite"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transfer_fixtures import save_safetensors, tiny_model

    return save_safetensors(tiny_model(32), tmp_path_factory.mktemp("ckpt") / "tiny.safetensors")


def _transfer(checkpoint, root: str, out, *overrides):
    from pretrain.transfer.cli import main

    main(["--checkpoint", str(checkpoint), "--suite", "shards", "--protocol", "fewshot", "--data-root", root,
          "--output", str(out), "eval.workers=0", "eval.batch_size=32", "eval.fewshot_shots=[1,5]",
          "eval.fewshot_seeds=2", *overrides])


def test_transfer_shards_suite_from_the_store_gives_the_numbers_of_disk(store, suite, checkpoint, tmp_path, proxy):
    """``vit-transfer --suite shards --data-root s3://...``: the same task (train/ test/, val/ found
    by asking the store) and the same few-shot accuracies, to the last digit, as from disk."""
    from data_pipeline.config import DataConfig
    from pretrain.transfer import suites

    disk, url = suite
    task = suites.shards(url, DataConfig(allow_remote=True))
    assert (task.name, task.num_classes, len(task.train), len(task.val), len(task.trainval), len(task.test)) == \
        ("suite", 10, 96, 40, 136, 40)
    for split in ("train", "test"):  # no val/ under this prefix: none, as on disk
        store.client.copy_object(Bucket=BUCKET, Key=f"noval/{split}/manifest.json",
                                 CopySource={"Bucket": BUCKET, "Key": f"suite/{split}/manifest.json"})
    assert suites.shards(f"s3://{BUCKET}/noval/", DataConfig(allow_remote=True)).val is None

    docs = {}
    for where, root in (("disk", str(disk)), ("store", url)):
        _transfer(checkpoint, root, tmp_path / f"{where}.json", "data.allow_remote=true")
        docs[where] = json.loads((tmp_path / f"{where}.json").read_text())["tasks"]["suite"]
        del docs[where]["seconds"]
    r = docs["store"]
    assert r == docs["disk"], docs  # accuracies, per-shot details, settings, counts
    assert r["num_train"] == 136 and r["num_test"] == 40 and r["accuracy"] > 0.1, r  # 10 classes: chance 0.1
    assert proxy.log == []


def test_transfer_shards_root_mistakes_are_one_line(store, suite, checkpoint, tmp_path, capsys):
    url = suite[1]
    for root, overrides, said in (
            (f"s3://{BUCKET}/demo", ["data.allow_remote=true"],  # demo/train only
             f"s3://{BUCKET}/demo/test/manifest.json: not found (shards suite: ROOT/train and ROOT/test, each with "
             "shards + manifest.json)"),
            (url, [], f"{url}: an s3:// shards root needs data.allow_remote=true (it reaches the network)"),
            ("https://example.org/suite", ["data.allow_remote=true"], "https://example.org/suite: the shards suite "
             "reads a folder or s3://bucket/prefix (https: URLs cannot be searched for train/ test/ val/)")):
        with pytest.raises(SystemExit) as e:
            _transfer(checkpoint, root, tmp_path / "r.json", *overrides)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == f"vit-transfer: error: {said}\n", err
    assert not (tmp_path / "r.json").exists()


def _reader(store) -> dict:
    """AWS_* variables of a user who may read the bucket but not write to it."""
    import boto3

    iam = boto3.client("iam", endpoint_url=store.server.url, region_name="us-east-1",
                       aws_access_key_id=store.server.env["AWS_ACCESS_KEY_ID"],
                       aws_secret_access_key=store.server.env["AWS_SECRET_ACCESS_KEY"])
    name = f"reader{os.getpid()}"
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                                                "Resource": "*"}]}))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


def test_audit_finds_the_pairs_of_disk_with_either_side_in_the_store(store, suite, tmp_path, capsys, monkeypatch):
    """vit-audit with the evaluation ROOT or the pre-training shards in the store reports the pairs it
    reports from disk. Pre-training shards: test/ (40 images); evaluation: the ROOT, whose test/ and
    val/ hold those very images (80 exact pairs) and train/ other ones. hashes.npz goes to the
    prefix and is reused; a user who may not write there gets the hashes for the run only."""
    from data_pipeline.audit import index
    from pretrain.evaluation import audit as vit_audit

    disk, url = suite

    def pairs(shards: str, evals: str, name: str) -> list:
        out = tmp_path / name
        assert vit_audit.main(["--shards", shards, "--eval", f"shards:{evals}", "--output", str(out), "--quiet",
                               "--grid", "2"]) == 0
        said = capsys.readouterr().out.splitlines()
        assert said[-1].startswith("80 pairs") and f"{index.manifest_url(shards)}: 40 of 40 samples audited" in said
        doc = json.loads((out / "audit.json").read_text())
        assert doc["shards"][0]["manifest"] == index.manifest_url(shards) and doc["evals"][0]["images"] == 176
        return sorted(tuple(v for k, v in p.items() if k != "manifest") for p in doc["pairs"])

    ref = pairs(str(disk / "test"), str(disk), "disk")
    assert len(ref) == 80 and {(p[0], p[1]) for p in ref} == {("shards/suite", "test"), ("shards/suite", "val")}
    assert all(p[2] == p[3] and p[-2] == "exact" for p in ref), ref[:3]  # (eval_id, train_key, ..., match, mirrored)
    assert pairs(str(disk / "test"), url, "eval_in_store") == ref

    stored = "suite/test/hashes.npz"
    with monkeypatch.context() as m:
        for k, v in _reader(store).items():
            m.setenv(k, v)
        assert vit_audit.main(["--index", f"{url}/test", "--quiet"]) == 0
        out, err = capsys.readouterr()
        assert out == "40 of 40 samples hashed -> hashes.npz not stored (see the note above)\n", out
        assert err == (f"vit-audit: note: cannot store {url}/test/hashes.npz (S3 403 AccessDenied: check the "
                       "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials) "
                       "and that they may access this bucket); the hashes are used for this run only\n"), err
        assert pairs(f"{url}/test/manifest.json", str(disk), "read_only") == ref
    assert "Contents" not in store.client.list_objects_v2(Bucket=BUCKET, Prefix=stored)

    assert pairs(f"{url}/test/manifest.json", str(disk), "shards_in_store") == ref
    etag = store.client.head_object(Bucket=BUCKET, Key=stored)["ETag"]
    built = []
    real_build = index.build_index
    monkeypatch.setattr(index, "build_index", lambda *a, **k: built.append(a) or real_build(*a, **k))
    assert vit_audit.main(["--index", f"{url}/test/", "--quiet"]) == 0  # the stored hashes, fingerprint checked
    assert capsys.readouterr().out == f"40 of 40 samples hashed -> {url}/test/hashes.npz\n"
    assert built == [] and store.client.head_object(Bucket=BUCKET, Key=stored)["ETag"] == etag
    assert vit_audit.main(["--index", f"{url}/test", "--force", "--quiet"]) == 0
    assert len(built) == 1


def _job(tiny_run, shards: str, name: str):
    return tiny_run("data.allow_remote=true", "data.workers=1", "data.record_samples=true",
                    "data.remote_retry_s=20", "train.log_every_steps=1", "optim.warmup_steps=2",
                    "checkpoint.every_steps=3", "train.steps=6",  # 96 samples: one epoch
                    shards=shards, name=name, via="deepspeed", ranks=2)


def _records(job) -> dict[str, str]:
    return {f.name: f.read_text() for f in sorted((job.run_dir / "samples").glob("rank-*.tsv"))}


@pytest.mark.slow
def test_two_ranks_train_from_the_store_through_a_cut_and_a_kill_on_the_samples_of_disk(store, written, proxy,
                                                                                       tiny_run, tmp_path):
    """The deepspeed runner, 2 ranks x 1 data worker: the store is cut mid-shard and refuses
    connections for 1 s; the job is killed (SIGKILL, every process) in step 5, after its step-3
    checkpoint, and the same command resumes it. Each rank records exactly the (step, epoch, key)
    rows of the same run from disk, straight through."""
    disk = _job(tiny_run, str(written[0]), "disk")
    disk_log = tmp_path / "disk.log"
    with reaped(disk.start(disk_log)) as reference:  # the run from disk goes on beside the store's
        proxy.plan([(150_000, 1.0, 0)])
        s3 = _job(tiny_run, written[1], "s3")
        ckpt = s3.run_dir / "checkpoints" / "step_00000003" / "COMPLETE"
        log = tmp_path / "killed.log"
        with reaped(s3.start(log, VITSCALE_FAULT="hang_in_step:5")) as p:
            wait_for(lambda: ckpt.exists() and max(metrics(s3.run_dir), default=0) >= 4, 300, p, "checkpoint 3, step 4")
            kill_group(p, signal.SIGKILL)
            p.wait(60)
        assert reference.wait(600) == 0, disk_log.read_text()[-3000:]
    assert proxy.events == [] and "cut" in proxy.log, proxy.log
    r = s3.run(600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 3" in r.stderr, r.stderr[-3000:]
    ours, theirs = _records(s3), _records(disk)
    assert sorted(theirs) == ["rank-0.tsv", "rank-1.tsv"] and len(theirs["rank-0.tsv"].splitlines()) == 48
    assert ours == theirs  # no sample twice, none skipped, the same order on each rank
    m = metrics(tmp_path / "s3")
    assert sorted(m) == list(range(1, 7))
    assert max(r.get("data/remote_retries", 0) for r in m.values()) >= 1, m[max(m)]
    assert not any(k in r for r in m.values() for k in ("data/lost_in_shard", "data/missing_shard"))


def _disk_keys(job, local, rows: int) -> list[str]:
    """The first ``rows`` sample keys the loader gives ``job``'s config from the disk copy ``local``:
    what the job's sample log (data.record_samples) must list, in order."""
    from pretrain.config import load_config

    cfg = load_config(TINY_CONFIG, [*job.overrides(), f"data.train_shards={local}"])
    loader = build_loader(cfg.data, batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed,
                          img_size=cfg.model.img_size)
    keys = []
    for _ in loader:
        keys += loader.last_keys
        if len(keys) >= rows:
            return keys[:rows]
    raise AssertionError("the disk loader ended first")


def _logged_keys(job, steps: int) -> list[str]:
    rows = [line.split("\t") for line in (job.run_dir / "samples" / "rank-0.tsv").read_text().splitlines()]
    assert [int(r[0]) for r in rows] == [s for s in range(1, steps + 1) for _ in range(16)], "a step twice or lost"
    return [r[2] for r in rows]


# one process, two epochs of the 96 samples (6 steps each); the shuffle buffer holds a whole epoch, so
# the store is read at steps 1 and 7
OUTAGE_RUN = ("data.allow_remote=true", "data.record_samples=true", "train.log_every_steps=1",
              "checkpoint.every_steps=2", "train.steps=12")
# the save of step 6 holds still (faults.STALL_S) once the first shard (steps 1-6) is read: the store is
# cut then, whatever the host's speed, and step 7 opens the next shard. A poll for a checkpoint instead
# can miss it on a fast host: keep_last prunes it within a few steps.
OUTAGE_STALL = {"VITSCALE_FAULT": "stall_in_save:6@0"}


def wait_for_the_stall(job, p) -> None:
    wait_for(lambda: (job.run_dir / "checkpoints" / ".stall_in_save.6").exists(), 300, p, "the save of step 6")


@pytest.mark.slow
def test_a_run_rides_out_a_45_s_stop_of_the_store(store, written, proxy, tiny_run, tmp_path):
    """The store stops (every connection refused) during the save of step 6 and comes back 45 s
    later; with data.remote_retry_s=60 the run waits at step 7 and goes on: done, a line when the
    outage started and one when it ended, the sample log that of the run from disk."""
    from pretrain.resilience.faults import STALL_S

    job = tiny_run(*OUTAGE_RUN, "data.remote_retry_s=60", shards=written[1], name="rides")
    log = tmp_path / "rides.log"
    with reaped(job.start(log, **OUTAGE_STALL)) as p:
        wait_for_the_stall(job, p)
        cut_at = time.monotonic()
        proxy.cut(refuse_s=45.0)
        code = p.wait(240)
        took = time.monotonic() - cut_at
    out = log.read_text()
    assert code == 0 and "vit-train: done at step 12" in out, out[-3000:]
    start = [x for x in out.splitlines() if "unreachable (" in x and "for up to 60 s (data.remote_retry_s)" in x]
    end = [x for x in out.splitlines() if "reachable again after" in x]
    assert len(start) == len(end) == 1 and start[0].startswith(f"{written[1]}/train-"), out[-3000:]
    lasted = float(end[0].split("after ")[1].split(" s")[0])
    # away 45 s, seen from step 7 (after the stall) to the next try
    assert 45.0 - STALL_S - 2.0 < lasted < 54.0 and took >= 45.0, (end, took)
    print(f"store stopped 45 s: {end[0]}; run done {took:.0f} s after the stop")
    assert _logged_keys(job, 12) == _disk_keys(job, written[0], 12 * 16)  # no sample twice, none lost
    m = metrics(job.run_dir)
    assert sorted(m) == list(range(1, 13)) and max(r.get("data/remote_retries", 0) for r in m.values()) >= 1


@pytest.mark.slow
def test_store_gone_for_good_ends_the_run_with_exit_69_and_vit_launch_restarts_it(store, written, proxy,
                                                                                  tiny_run, tmp_path):
    """vit-launch --max-restarts 1 over one rank: from the save of step 6 on, the store refuses every
    connection; the job ends within the stall and data.remote_retry_s (+ a step and the exit) with one
    line naming the shard and the bound and exit 69, which vit-launch restarts; the store is back by
    then, and the job resumes from its last checkpoint and ends, its sample log that of the run from
    disk."""
    from pretrain.resilience.faults import STALL_S

    bound = 3.0
    job = tiny_run(*OUTAGE_RUN, f"data.remote_retry_s={bound:g}", shards=written[1], name="gone", via="launch",
                   launch_args=("--max-restarts", "1", "--restart-backoff", "5"))
    log = tmp_path / "gone.log"
    with reaped(job.start(log, **OUTAGE_STALL)) as p:
        wait_for_the_stall(job, p)
        cut_at = time.monotonic()
        proxy.cut(refuse_s=600)  # gone for good, as far as this attempt can tell
        wait_for(lambda: "restart 1/1 in" in log.read_text(), STALL_S + bound + 60, p, "the restart")
        took = time.monotonic() - cut_at
        proxy.reset()  # the store is back before the second attempt reads it
        code = p.wait(300)
    out = log.read_text()
    failed = out.split("restart 1/1 in")[0].splitlines()
    errors = [x for x in failed if x.startswith("vit-train: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"vit-train: error: {written[1]}/train-"), out[-3000:]
    assert "server unreachable" in errors[0] and f"data.remote_retry_s={bound:g}" in errors[0], errors
    assert failed[-1].startswith("vit-launch: the job failed with exit code 69;"), failed[-3:]
    assert took < STALL_S + bound + 20, took  # the stall, the bound, a step, then the exit (DeepSpeed and the process)
    print(f"store gone in the save of step 6: exit 69 and the restart line {took:.1f} s after the cut "
          f"(stall {STALL_S:g} s, bound {bound:g} s)")
    assert code == 0 and "vit-launch: the job completed (exit 0)" in out, out[-3000:]
    resumed = out.split("restart 1/1 in")[1]
    assert "resuming from step 6" in resumed and "vit-train: done at step 12" in resumed, resumed[-3000:]
    assert _logged_keys(job, 12) == _disk_keys(job, written[0], 12 * 16)  # no sample twice, none lost


def test_exports_go_to_the_store_one_object_per_file(store, tmp_path):
    """vit-export to s3://: the timm file and each file of a transformers folder become objects with
    the bytes of the same export on disk; a missing bucket is one line before any work."""
    import boto3
    import torch
    from safetensors import safe_open
    from transfer_fixtures import tiny_model, write_run_dir

    from pretrain.weights.export import export, export_hf, export_to

    run = write_run_dir(tmp_path / "run", tiny_model(), {3: True}, 3)
    s3 = boto3.client("s3")

    def body(key):
        return s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    r = export_to(run, f"s3://{BUCKET}/exports/tiny.safetensors")
    assert r["output"] == f"s3://{BUCKET}/exports/tiny.safetensors" and r["step"] == 3
    local = export(run, tmp_path / "tiny.safetensors")
    (tmp_path / "from_store.safetensors").write_bytes(body("exports/tiny.safetensors"))
    with safe_open(tmp_path / "from_store.safetensors", "pt") as a, safe_open(local["output"], "pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    export_to(run, f"s3://{BUCKET}/exports/hf/", fmt="hf")
    export_hf(run, tmp_path / "hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="exports/hf/")["Contents"])
    assert listed == [f"exports/hf/{n}" for n in files] and "model.safetensors" in files
    # (safetensors writes its metadata in no fixed order: the weights file is compared by its tensors)
    assert all(body(f"exports/hf/{n}") == (tmp_path / "hf" / n).read_bytes() for n in files if n != "model.safetensors")
    (tmp_path / "hf_store.safetensors").write_bytes(body("exports/hf/model.safetensors"))
    with safe_open(tmp_path / "hf_store.safetensors", "pt") as a, \
            safe_open(tmp_path / "hf" / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    r = run_job([sys.executable, "-m", "pretrain.export", str(run), "s3://no-such-bucket/x.safetensors"], timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no-such-bucket" in r.stderr, r.stderr


def test_the_loading_line_of_an_export_to_the_store_names_the_download(store, tmp_path, monkeypatch, capsys):
    """The hf folder exported to s3://.../card/ is downloaded by the printed aws line into ./card,
    and the printed from_pretrained line loads that folder, not a local path spelt like the URL."""
    from transfer_fixtures import tiny_model, write_run_dir

    from pretrain.weights.export import main as export_main

    run = write_run_dir(tmp_path / "run", tiny_model(), {3: True}, 3)
    monkeypatch.chdir(tmp_path)
    export_main([str(run), f"s3://{BUCKET}/exports/card/", "--format", "hf"])
    out, err = capsys.readouterr()
    assert f"aws s3 cp --recursive s3://{BUCKET}/exports/card card)" in err, err
    assert f"from_pretrained({str(tmp_path / 'card')!r})" in out, out
