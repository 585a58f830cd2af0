"""Shards over HTTP (``data.train_shards: http://...`` with ``data.allow_remote``), against a real
HTTP server on 127.0.0.1 (tests/jobs/shard_http_server.py, its own process, stopped by PID): the same
batches as from disk; the server crashing mid-shard and coming back resumes the shard at its byte
(no sample twice, none skipped), counts the retries and says when the outage started and ended; a
server that stays away ends the read within data.remote_retry_s naming the URL (an outage, exit 69,
not a user error); a 429/503 Retry-After is waited for, within that bound; a 404, an untrusted
certificate and a malformed port are one line; a rate-limited server is only slow."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch
from dist_utils import free_port, wait_for
from shard_utils import one_epoch, remote_data_cfg

from data_pipeline.errors import DataError
from data_pipeline.loading.loader import build_loader
from data_pipeline.storage.http import HTTPShard
from data_pipeline.storage.retry import RemotePolicy, StoreUnreachable
from data_pipeline.tally import Tally

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "tests" / "jobs" / "shard_http_server.py"


class Server:
    """The test server as a process; ``start`` again on the same port after it died or was stopped."""

    def __init__(self, root: Path, log: Path):
        self.root, self.log, self.port, self.proc = root, log, free_port(), None
        self.lock, self.closed = threading.Lock(), False  # closed: stop() was called, no restart

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *flags: str) -> "Server":
        self.proc = subprocess.Popen([sys.executable, str(SERVER), str(self.root), str(self.port), *flags],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), start_new_session=True)
        end = time.time() + 20
        while f"on 127.0.0.1:{self.port}" not in self.log.read_text().split("serving")[-1]:
            if self.proc.poll() is not None or time.time() > end:
                raise AssertionError(f"test HTTP server did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        with self.lock:
            self.closed = True
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()  # by PID: the process this object started
                self.proc.wait(10)

    def requests(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line.startswith("GET ")]

    def restart_after_death(self, delay: float, *flags: str, meanwhile=None) -> threading.Thread:
        """Once the process has died (--die-after), start it again ``delay`` seconds later with ``flags``,
        having called ``meanwhile()`` (if given) while it was down."""
        def watch():
            proc = self.proc
            while proc.poll() is None and not self.closed:
                time.sleep(0.05)
            if meanwhile is not None:
                meanwhile()
            time.sleep(delay)
            with self.lock:
                if not self.closed:
                    self.start(*flags)
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        return t


@pytest.fixture(scope="module")
def served(shard_kit, tmp_path_factory):
    """8 shards x 12 samples (label = sample id) in a folder the server serves."""
    return shard_kit.id_shards(tmp_path_factory.mktemp("http") / "shards", [12] * 8)


@pytest.fixture
def server(served, tmp_path):
    s = Server(served, tmp_path / "server.log")
    yield s
    s.stop()




@pytest.fixture(scope="module")
def from_disk(served):
    batches, counters = one_epoch(remote_data_cfg(str(served)))
    assert counters["samples"] == 96 and len(batches) == 12
    return batches


def _same(a, b):
    assert [k for k, _, _ in a] == [k for k, _, _ in b]
    for (_, ya, xa), (_, yb, xb) in zip(a, b):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_http_reads_the_same_batches_as_disk(server, from_disk):
    server.start()
    batches, counters = one_epoch(remote_data_cfg(f"{server.url}/manifest.json"))
    _same(batches, from_disk)
    assert counters == {"samples": 96}
    assert not [r for r in server.requests() if "range=None" not in r]  # no retry, no Range request


def test_server_crash_mid_shard_resumes_at_the_byte(server, from_disk, served):
    """In a dataloader worker: the retries reach ``loader.counters`` (the ``data/*`` metrics)."""
    size = (served / "train-000003.tar").stat().st_size
    server.start("--die-after", f"train-000003.tar:{size // 2}")
    server.restart_after_death(2.0)
    batches, counters = one_epoch(remote_data_cfg(f"{server.url}/manifest.json", workers=1))
    _same(batches, from_disk)  # every sample once, in the same order, bit for bit
    assert counters["remote_retries"] >= 2, counters  # refused while the server was down
    assert not {"lost_in_shard", "truncated_tar", "missing_shard"} & set(counters), counters
    resumed = [r for r in server.requests() if r.startswith("GET /train-000003.tar range=bytes=")]
    assert resumed == [f"GET /train-000003.tar range=bytes={size // 2}- -> 206"], server.requests()


def test_retries_while_a_resume_fast_forwards_are_counted(server, from_disk, served, tmp_path):
    """A resumed loader re-reads, undecoded, the tar members before its position: the server crashing
    then is retried as ever, the samples go on at the resume point and those retries, this run's own
    requests, count in remote_retries (the data events of that stretch were counted by the first run)."""
    cfg = remote_data_cfg(f"{server.url}/manifest.json")
    server.start()
    first = build_loader(cfg, batch_size=8, seed=3, img_size=16)
    for i, _ in enumerate(first, 1):
        if i == 6:
            break
    state = first.state()
    server.stop()
    name = first.plan.slot_pieces(0, 0)[0].shard.name  # read again while fast-forwarding
    again = Server(served, tmp_path / "again.log")
    again.port = server.port
    try:
        again.start("--die-after", f"{name}:{(served / name).stat().st_size // 2}")
        again.restart_after_death(0.5)
        resumed = build_loader(cfg, batch_size=8, seed=3, img_size=16)
        resumed.resume([state])
        keys = []
        for _ in resumed:
            keys.append(list(resumed.last_keys))
            if resumed.epoch == 1:
                break
    finally:
        again.stop()
    assert keys == [k for k, _, _ in from_disk[6:]]
    assert resumed.counters.get("remote_retries", 0) >= 1, resumed.counters
    assert set(resumed.counters) == {"samples", "remote_retries"}, resumed.counters


def test_manifest_retries_are_counted_by_the_training_loader(server, from_disk):
    """The manifest is read before the loader exists; its retries (two 503s) still reach the
    loader's counters, the ``data/*`` metrics, once, and again on a resumed loader."""
    server.start("--busy", "2")
    cfg = remote_data_cfg(f"{server.url}/manifest.json")
    batches, counters = one_epoch(cfg)
    _same(batches, from_disk)
    get = "GET /manifest.json range=None -> "
    assert server.requests()[:3] == [get + "503", get + "503", get + "200"]
    assert counters == {"samples": 96, "remote_retries": 2}, counters
    server.stop()
    server.start("--busy", "1")
    loader = build_loader(cfg, batch_size=8, seed=3, img_size=16)
    loader.resume([dataclasses.replace(loader.state(), counters={"samples": 8, "remote_retries": 5})])
    read = loader.plan.shardset.read_retries  # the 503, perhaps a refused connect before the port opened
    assert read >= 1 and loader.counters == {"samples": 8, "remote_retries": 5 + read}  # the checkpoint's + this


@pytest.mark.parametrize("restart", [["--no-range"], ["--busy", "1"], ["--busy", "1", "--busy-status", "520"]],
                         ids=["no-range", "busy-503", "busy-520"])
def test_server_back_without_range_support_or_busy(server, from_disk, served, restart):
    """The server comes back ignoring Range (200, whole file: the bytes already read are skipped),
    or answering 503 (or a CDN's 520: every 5xx) for a while (retried like a refused connect)."""
    size = (served / "train-000006.tar").stat().st_size
    server.start("--die-after", f"train-000006.tar:{size // 2}")
    server.restart_after_death(0.5, *restart)
    batches, counters = one_epoch(remote_data_cfg(f"{server.url}/manifest.json"))
    _same(batches, from_disk)
    assert counters["remote_retries"] >= (2 if "--busy" in restart else 1), counters
    assert set(counters) == {"samples", "remote_retries"}, counters
    after = [r for r in server.requests() if r.startswith("GET /train-000006.tar")][1:]
    at = f"GET /train-000006.tar range=bytes={size // 2}-"
    busy = restart[restart.index("--busy-status") + 1] if "--busy-status" in restart else "503"
    want = [f"{at} -> 200"] if "--no-range" in restart else [f"{at} -> {busy}", f"{at} -> 206"]
    assert after == want, after


@pytest.mark.parametrize("after, flags, bound, least", [("2", [], 20.0, 2.0), ("2", ["--retry-after-date"], 20.0, 1.95),
                                                    ("60", [], 1.5, 1.5)], ids=["seconds", "http-date", "capped"])
def test_retry_after_is_waited_for_within_the_bound(server, served, capsys, after, flags, bound, least):
    """A 503 with ``Retry-After`` (seconds, or an HTTP-date: the server rounds it up to the second) is
    tried again no sooner than it asks, not after the backoff's 0.25 s, and counts as a retry; a wait
    longer than data.remote_retry_s is cut to the bound, where the last try is made."""
    name = "train-000001.tar"
    server.start("--busy", "1", "--retry-after", after, *flags)
    tally = Tally()
    t0 = time.monotonic()
    with HTTPShard(f"{server.url}/{name}", name, RemotePolicy(retry_s=bound, timeout_s=5.0), tally) as f:
        took = time.monotonic() - t0
        assert f.read() == (served / name).read_bytes()
    assert least <= took < min(float(after), bound) + 1.0, took
    assert tally.counts == {"remote_retries": 1}, tally.counts
    assert [r.split(" range=")[0] for r in server.requests()] == [f"GET /{name}"] * 2, server.requests()
    assert "HTTP 503 Service Unavailable (Retry-After: " in capsys.readouterr().err


def test_shard_rewritten_while_the_server_was_away_is_one_line_not_a_mix(server, served, tmp_path):
    """The server crashes mid-shard and comes back serving a rewritten file under that name: the
    resumed answer is of another file (ETag and Last-Modified changed), so the read stops with one
    line naming the shard instead of going on with the bytes of another tar."""
    root = tmp_path / "rewritten"
    shutil.copytree(served, root)  # copy2: the same mtimes, so the other shards keep their validators
    size = (served / "train-000003.tar").stat().st_size
    server.root = root
    server.start("--die-after", f"train-000003.tar:{size // 2}")

    def rewrite():  # another tar under the name, with a new mtime, as a rewrite gives
        (root / "train-000003.tar").write_bytes((served / "train-000004.tar").read_bytes())

    server.restart_after_death(0.5, meanwhile=rewrite)
    with pytest.raises(DataError) as e:
        one_epoch(remote_data_cfg(f"{server.url}/manifest.json"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{server.url}/train-000003.tar: the shard train-000003.tar changed on "
                                              f"the server while it was being read at byte {size // 2} (ETag "), msg


def test_resumed_answer_from_another_byte_is_refused_not_mixed(server, served):
    """The server crashes mid-shard and comes back answering the resumed range from 100 bytes
    before the one asked (its Content-Range says so): no byte of it reaches the reader, which tries
    again until data.remote_retry_s and then names the range it was sent."""
    name = "train-000005.tar"
    at = (served / name).stat().st_size // 2
    server.start("--die-after", f"{name}:{at}")
    server.restart_after_death(0.2, "--range-early", "100")
    got = bytearray()
    with pytest.raises(StoreUnreachable) as e:
        with HTTPShard(f"{server.url}/{name}", name, RemotePolicy(retry_s=3.0, timeout_s=5.0)) as f:
            while chunk := f.read(4096):
                got += chunk
    assert bytes(got) == (served / name).read_bytes()[:at]
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{server.url}/{name}: server unreachable"), msg
    assert f"last error: resumed at byte {at} but the server sent Content-Range 'bytes {at - 100}-" in msg, msg


def test_server_gone_for_good_ends_within_the_bound(server, served):
    size = (served / "train-000002.tar").stat().st_size
    server.start("--die-after", f"train-000002.tar:{size // 3}")
    cfg = remote_data_cfg(f"{server.url}/manifest.json", remote_retry_s=3.0)
    loader = build_loader(cfg, batch_size=8, seed=3, img_size=16)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable) as e:
        for _ in loader:
            pass
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{server.url}/train-000002.tar: server unreachable"), msg
    assert "data.remote_retry_s=3" in msg and "Connection refused" in msg, msg
    assert took < 3.0 + 5.0, took  # the bound, plus reading the shards before the crash


def test_manifest_read_follows_the_runs_remote_keys():
    """The manifest at start-up is retried under the run's data.remote_retry_s, as its shards are:
    here a short bound ends at once, naming the bound the user set."""
    url = f"http://127.0.0.1:{free_port()}/manifest.json"  # nobody listening: refused
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable) as e:
        build_loader(remote_data_cfg(url, remote_retry_s=1.5), batch_size=8)
    took = time.monotonic() - t0
    assert 1.5 <= took < 4.0, took
    assert str(e.value).startswith(f"{url}: server unreachable") and "data.remote_retry_s=1.5" in str(e.value), e.value


def test_missing_shard_on_the_server_is_one_line_naming_it(server, served, tmp_path):
    root = tmp_path / "partial"
    shutil.copytree(served, root)
    (root / "train-000005.tar").unlink()
    server.root = root
    server.start()
    with pytest.raises(DataError) as e:
        for _ in build_loader(remote_data_cfg(f"{server.url}/manifest.json"), batch_size=8, seed=3, img_size=16):
            pass
    assert str(e.value).startswith(f"{server.url}/train-000005.tar: HTTP 404 Not Found: shard train-000005.tar "
                                   "is listed in the manifest but not on the server"), e.value
    with pytest.raises(DataError,
                       match=r"manifest\.json: HTTP 404 Not Found: not on the server \(data\.train_shards\)"):
        build_loader(remote_data_cfg(f"{server.url}/nope/manifest.json"), batch_size=8, seed=3, img_size=16)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/manifest.json", "http://127.0.0.1:abc/manifest.json"],
                         ids=["out-of-range", "not-a-number"])
def test_malformed_port_is_one_line_not_an_outage(url):
    """A port that is no port (99999 would even reach port 34463, wrapped) is the user's mistake:
    one line naming the URL at once (exit 2), not an outage retried for data.remote_retry_s, exit 69."""
    from data_pipeline.errors import EXIT_USAGE, exit_code

    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        build_loader(remote_data_cfg(url), batch_size=8)
    assert time.monotonic() - t0 < 1.0
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{url}: not a valid URL (port "), msg
    assert msg.endswith("(data.train_shards)") and exit_code(e.value) == EXIT_USAGE, msg


def test_untrusted_tls_certificate_is_one_line_not_an_outage(tmp_path):
    """A certificate no CA the client knows signed does not change by waiting: one line naming the URL
    and SSL_CERT_FILE at once, not an outage retried for data.remote_retry_s and then exit 69."""
    from tls_server import UntrustedTLS

    with UntrustedTLS(tmp_path) as url:
        t0 = time.monotonic()
        with pytest.raises(DataError) as e:
            build_loader(remote_data_cfg(f"{url}/manifest.json"), batch_size=8)
        assert time.monotonic() - t0 < 2.0
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{url}/manifest.json: TLS certificate not trusted ("), msg
    assert "SSL_CERT_FILE" in msg and msg.endswith("(data.train_shards)"), msg


def _needed_bytes(tar: Path) -> int:
    """Bytes of ``tar`` up to the end of its last member's data: what a reader must receive (the
    end-of-archive blocks and record padding after it are never waited for)."""
    with tarfile.open(tar) as t:
        last = t.getmembers()[-1]
    return last.offset_data + last.size


def test_rate_limited_server_is_slow_not_an_error(server, served, from_disk):
    needed = sum(_needed_bytes(p) for p in served.glob("*.tar"))
    rate = needed / 1.5  # the epoch's samples take at least 1.5 s to arrive, one shard after the other
    server.start("--rate", str(rate))
    t0 = time.monotonic()
    batches, counters = one_epoch(remote_data_cfg(f"{server.url}/manifest.json"))
    assert time.monotonic() - t0 >= 1.4
    _same(batches, from_disk)
    assert counters == {"samples": 96}


def test_remote_keys_are_checked(tmp_path):
    from data_pipeline.errors import ConfigError
    from pretrain.config import load_config

    for bad, says in (("data.remote_retries=8", "data.remote_retries: 8 would end an outage after 31.75 s, before "
                                                "data.remote_retry_s=120 (the bound; this is only a guard): leave it "
                                                "out, or at least 20"),
                      ("data.remote_retries=-1", "-1 would end an outage after 0 s"),
                      ("data.remote_retry_s=0", "must be > 0 seconds")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(str(REPO / "configs" / "tiny_cpu.yaml"), [bad])
    for ok in (["data.remote_retries=20"], ["data.remote_retry_s=60", "data.remote_retries=12"]):
        load_config(str(REPO / "configs" / "tiny_cpu.yaml"), ok)
    with pytest.raises(DataError, match="needs data.allow_remote=true"):
        build_loader(remote_data_cfg("http://127.0.0.1:1/manifest.json", allow_remote=False), batch_size=8)


def test_training_over_http_resumes_a_shard_then_ends_on_a_dead_server(server, served, tiny_run, tmp_path):
    """``python -m pretrain.train`` reading a rate-limited server that crashes mid-shard and comes back
    2 s later: the recorded samples are exactly the disk loader's, the retries are in ``data/*``, the
    wait in ``data_wait_share`` and a line each says when the outage started and ended; then the
    server goes for good after a checkpoint: the run ends within data.remote_retry_s, exit 69, one
    line naming the URL, the checkpoint intact."""
    from pretrain.checkpointing import checkpoint
    from pretrain.config import load_config

    rate = ["--rate", "45000"]  # ~0.6 s per 12-sample shard: the loader, not the model, sets the pace
    size = (served / "train-000004.tar").stat().st_size
    server.start("--die-after", f"train-000004.tar:{size // 2}", *rate)
    server.restart_after_death(2.0, *rate)
    job = tiny_run("data.allow_remote=true", "data.record_samples=true", "data.remote_retry_s=4",
                   "data.shuffle_buffer=16", "model.num_classes=96", "train.steps=200", "train.log_every_steps=2",
                   "checkpoint.every_steps=8", "optim.warmup_steps=2",
                   shards=f"{server.url}/manifest.json")
    run_dir, overrides = job.run_dir, job.overrides()
    log = tmp_path / "train.log"
    proc = job.start(log)
    try:
        ckpts = run_dir / "checkpoints"
        wait_for(lambda: ckpts.is_dir() and checkpoint.latest_complete(ckpts) is not None, 400, proc,
                 f"the first checkpoint ({log})")
        server.stop()  # for good
        t0 = time.monotonic()
        proc.wait(60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    errors = [line for line in out.splitlines() if line.startswith("vit-train: error:")]
    assert proc.returncode == 69 and len(errors) == 1, out[-3000:]
    ended = [line for line in out.splitlines() if "reachable again after" in line]  # the crash, 2 s
    assert len(ended) == 1 and ended[0].startswith(f"{server.url}/train-000004.tar:"), out[-3000:]
    assert errors[0].startswith(f"vit-train: error: {server.url}/train-") and "server unreachable" in errors[0]
    assert took < 4 + 10, took  # the retry bound, plus the steps the prefetched batches still fed
    saved = checkpoint.latest_complete(ckpts)
    assert saved is not None and (saved / "run.json").is_file()

    rows = [line.split("\t") for line in (run_dir / "samples" / "rank-0.tsv").read_text().splitlines()]
    steps = int(rows[-1][0])
    assert steps >= 8 and len(rows) == 16 * steps, (steps, len(rows))
    disk = load_config(str(REPO / "configs" / "tiny_cpu.yaml"), [*overrides, f"data.train_shards={served}"])
    loader = build_loader(disk.data, batch_size=8, seed=disk.train.seed, img_size=64)
    keys = []
    for _ in loader:
        keys += loader.last_keys
        if len(keys) == len(rows):
            break
    assert [k for _, _, k in rows] == keys  # no sample twice, none skipped, the same order
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("data/remote_retries", 0) for m in metrics) >= 1, metrics[-1]
    assert max(m["data_wait_share"] for m in metrics) > 0.5, [m["data_wait_share"] for m in metrics]
