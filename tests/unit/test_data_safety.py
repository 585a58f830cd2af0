"""Hostile and broken data: pickle members, corrupt JPEGs, truncated tars, missing shards, bad
labels, decompression bombs, the corrupt-rate threshold, remote URLs and manifest mistakes."""
from __future__ import annotations

import io
import json
import pickle
import struct
import subprocess
import sys
import tarfile
import zlib
from collections import Counter
from pathlib import Path

import pytest

from data_pipeline.errors import DataError, TooManyCorruptSamples
from data_pipeline.loading.loader import build_loader
from pretrain.config import DataConfig


def _cfg(root, **kw):
    return DataConfig(train_shards=str(root), val_shards=str(root), workers=kw.pop("workers", 0),
                      shuffle_buffer=kw.pop("shuffle_buffer", 8), **kw)


def _samples(kit, start, n, **extra):
    return [(f"{i:05d}", {"jpg": kit.image_bytes(16, 16, seed=i), "cls": str(i % 4).encode(), **extra})
            for i in range(start, start + n)]


def _run(loader, batches):
    it = iter(loader)
    return [next(it) for _ in range(batches)]


class _Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (subprocess.call, (["touch", self.path],))


def test_pickle_members_are_never_unpickled(tmp_path, shard_kit):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Touch(str(marker)))
    shards = [_samples(shard_kit, 0, 8, pyd=payload, pickle=payload, pth=payload),
              _samples(shard_kit, 8, 8, pyd=payload)]
    root = shard_kit.make_shards(tmp_path / "s", shards, list("abcd"))
    loader = build_loader(_cfg(root, workers=2), world_size=1, batch_size=4, img_size=16)
    batches = _run(loader, 4)
    assert len(batches) == 4 and not marker.exists()
    assert loader.counters["unsafe_member"] == 8 * 3 + 8 and loader.counters["samples"] == 16
    # Prove the payload is live: the stock webdataset decoder *would* unpickle .pyd members.
    import webdataset as wds

    next(iter(wds.WebDataset(str(root / "train-000001.tar"), shardshuffle=False).decode()))
    assert marker.exists()


def test_corrupt_images_and_bad_labels_are_skipped_and_counted(tmp_path, shard_kit):
    samples = _samples(shard_kit, 0, 40)
    good_jpeg = samples[0][1]["jpg"]
    samples[3][1]["jpg"] = good_jpeg[: len(good_jpeg) // 2]  # truncated JPEG
    samples[7][1]["jpg"] = b"GIF89a not at all a jpeg"
    samples[11][1]["cls"] = b"seven"
    samples[13][1]["cls"] = b"99"  # outside the 4 classes
    del samples[17][1]["jpg"]
    root = shard_kit.make_shards(tmp_path / "s", [samples[:20], samples[20:]], list("abcd"))
    loader = build_loader(_cfg(root, max_corrupt_rate=0.2), batch_size=5, img_size=16)
    assert loader.batches_per_epoch == 8
    batches = _run(loader, 8)  # the promised count, although 5 samples were bad
    assert all(x.shape[0] == 5 for x, _ in batches)
    c = loader.counters
    assert c["corrupt_image"] == 2 and c["bad_label"] == 2 and c["no_image"] == 1
    assert c["repeated_for_balance"] == 5 and c["samples"] == 40  # bad ones refilled from a second pass


def test_truncated_tar_and_missing_shard(tmp_path, shard_kit):
    shards = [_samples(shard_kit, 20 * k, 20) for k in range(4)]
    root = shard_kit.make_shards(tmp_path / "s", shards, list("abcd"))
    raw = (root / "train-000001.tar").read_bytes()
    (root / "train-000001.tar").write_bytes(raw[: len(raw) // 2 + 100])
    (root / "train-000002.tar").unlink()
    loader = build_loader(_cfg(root, max_corrupt_rate=0.6), batch_size=10, img_size=16)
    _run(loader, loader.batches_per_epoch)
    c = loader.counters
    assert c["missing_shard"] == 1 and c["truncated_tar"] == 1
    assert 20 < c["lost_in_shard"] < 40 and c["samples"] == 80
    assert loader.state().epoch == 1


def test_corrupt_rate_threshold_names_worst_shard(tmp_path, shard_kit):
    shards = [_samples(shard_kit, 30 * k, 30) for k in range(4)]
    for i in range(0, 30, 6):  # 5 of 120 samples (4%) are corrupt, all in shard 2
        shards[2][i][1]["jpg"] = b"\xff\xd8 garbage"
    root = shard_kit.make_shards(tmp_path / "s", shards, list("abcd"))
    ok = build_loader(_cfg(root, max_corrupt_rate=0.05, workers=2), batch_size=6, img_size=16)
    _run(ok, ok.batches_per_epoch)
    assert ok.counters["corrupt_image"] == 5
    strict = build_loader(_cfg(root, max_corrupt_rate=0.01, workers=2), batch_size=6, img_size=16)
    with pytest.raises(TooManyCorruptSamples, match=r"exceed data.max_corrupt_rate=0.01; worst shards: "
                                                    r"train-000002.tar \(\d bad\)") as e:
        _run(strict, strict.batches_per_epoch)
    assert "\n" not in str(e.value)


def _emission_order(root, **layout) -> list[str]:
    """The keys one epoch of ``layout`` (one rank) consumes, in order: a bad sample takes the same
    place in that order (it is emitted, then skipped)."""
    loader = build_loader(_cfg(root, workers=0), seed=5, img_size=16, **layout)
    keys = []
    for _ in zip(range(loader.batches_per_epoch), loader):
        keys += loader.last_keys
    return keys


@pytest.mark.parametrize("rate, fails", [(0.05, True), (0.1, False)])
def test_corrupt_budget_of_an_epoch_survives_an_elastic_resume(tmp_path, shard_kit, rate, fails):
    """10 of an epoch's 120 samples are bad, 5 read before a checkpoint and 5 after. The stated rule
    (more than data.max_corrupt_rate of the epoch's samples bad: the run stops) decides the same
    whether the epoch runs through, or resumes elastically (another micro batch) at the checkpoint:
    the bad samples read before it count on."""
    shards = [_samples(shard_kit, 30 * k, 30) for k in range(4)]
    root = shard_kit.make_shards(tmp_path / "s", shards, list("abcd"))
    order = _emission_order(root, batch_size=6)
    assert len(order) == 120
    bad = set(order[10:60:10]) | set(order[100:120:4])  # 5 before position 72, 5 after 100
    for samples in shards:
        for key, members in samples:
            if key in bad:
                members["jpg"] = b"\xff\xd8 garbage"
    shard_kit.make_shards(root, shards, list("abcd"))  # the same names and counts: the same data position
    assert len(bad) == 10 and (10 > rate * 120) == fails

    def epoch(loader, batches):
        it = iter(loader)
        for _ in range(batches):
            next(it)

    through = build_loader(_cfg(root, workers=0, max_corrupt_rate=rate), batch_size=6, seed=5, img_size=16)
    old = build_loader(_cfg(root, workers=0, max_corrupt_rate=rate), batch_size=6, seed=5, img_size=16)
    epoch(old, 12)  # 72 good samples: the first 5 bad ones read, 77 emitted
    assert sum(old.state().epoch_bad_by_shard.values()) == 5
    new = build_loader(_cfg(root, workers=0, max_corrupt_rate=rate), batch_size=5, seed=5, img_size=16)
    new.resume([old.state()])
    assert 0 < new.batches_this_epoch < new.batches_per_epoch  # the rest of the epoch
    for loader, batches in ((through, through.batches_per_epoch), (new, new.batches_this_epoch)):
        if fails:
            with pytest.raises(TooManyCorruptSamples, match=r"epoch 0, rank 0: (6|7|8|9|10) bad samples"):
                epoch(loader, batches)
        else:
            epoch(loader, batches)
            assert loader.counters["corrupt_image"] == 10  # rank 0 carries the old ranks' counters


def test_elastic_resume_shares_the_epochs_bad_samples_out_over_the_new_ranks(tmp_path, shard_kit):
    """Two old ranks' bad samples of the epoch so far, resumed on three: each new rank carries a
    third (rounded), the shards' counts add up to the old ones, and an exact resume keeps them."""
    shards = [_samples(shard_kit, 30 * k, 30) for k in range(4)]
    for i in range(0, 30, 3):
        shards[1][i][1]["jpg"] = b"\xff\xd8 garbage"
    shards[3][0][1]["jpg"] = b"\xff\xd8 garbage"
    root = shard_kit.make_shards(tmp_path / "s", shards, list("abcd"))
    cfg = _cfg(root, workers=0, max_corrupt_rate=0.5)
    olds = [build_loader(cfg, rank=r, world_size=2, batch_size=6, seed=5, img_size=16) for r in range(2)]
    for loader in olds:
        _run(loader, 6)
    states = [loader.state() for loader in olds]
    before = Counter()
    for st in states:
        before.update(st.epoch_bad_by_shard)
    assert sum(before.values()) >= 2
    news = [build_loader(cfg, rank=r, world_size=3, batch_size=4, seed=5, img_size=16) for r in range(3)]
    for loader in news:
        loader.resume(states)
    carried = [Counter(loader.state().epoch_bad_by_shard) for loader in news]
    assert sum(carried, Counter()) == before
    assert sorted(sum(c.values()) for c in carried) == sorted((sum(before.values()) * (r + 1)) // 3
                                                              - (sum(before.values()) * r) // 3 for r in range(3))
    again = build_loader(cfg, rank=1, world_size=3, batch_size=4, seed=5, img_size=16)
    again.resume([news[1].state()])  # the same layout: exact
    assert again.state().epoch_bad_by_shard == dict(carried[1])


def test_slot_without_any_readable_shard_fails_loudly(tmp_path, shard_kit):
    root = shard_kit.make_shards(tmp_path / "s", [_samples(shard_kit, 10 * k, 10) for k in range(2)], list("abcd"))
    (root / "train-000000.tar").write_bytes(b"this is not a tar file" * 30)
    loader = build_loader(_cfg(root, max_corrupt_rate=1.0), world_size=2, rank=0, batch_size=5, seed=0, img_size=16)
    other = build_loader(_cfg(root, max_corrupt_rate=1.0), world_size=2, rank=1, batch_size=5, seed=0, img_size=16)
    broken = [ld for ld in (loader, other) if ld.plan.slot_shards(0, ld.rank)[0].name == "train-000000.tar"][0]
    with pytest.raises(TooManyCorruptSamples, match="none of its shards .*train-000000.tar"):
        _run(broken, 1)


def test_slot_whose_every_image_is_damaged_fails_loudly_instead_of_spinning(tmp_path, shard_kit):
    """The tar reads, but none of the slot's JPEGs decodes: repeating its pass (meant for a slot whose
    slack bad samples ate) could never fill a batch and spun silently for ever; the slot is starved
    after one whole pass and the rank says so in one line. With ``max_corrupt_rate=1.0`` nothing
    else would stop it."""
    import threading

    shards = [_samples(shard_kit, 10 * k, 10) for k in range(2)]
    for _, members in shards[0]:
        members["jpg"] = b"\xff\xd8 not a jpeg"
    root = shard_kit.make_shards(tmp_path / "s", shards, list("abcd"))
    loaders = [build_loader(_cfg(root, max_corrupt_rate=1.0), world_size=2, rank=r, batch_size=5, seed=0,
                            img_size=16) for r in (0, 1)]
    broken = [ld for ld in loaders if ld.plan.slot_shards(0, ld.rank)[0].name == "train-000000.tar"][0]
    raised = []

    def first_batch():
        try:
            _run(broken, 1)
        except TooManyCorruptSamples as e:
            raised.append(e)

    reader = threading.Thread(target=first_batch, daemon=True)  # a spinning reader must not hang the suite
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "the reader still spins on a slot without a decodable image"
    assert raised and "none of its shards (train-000000.tar) yielded a readable sample in epoch 0" in str(raised[0])


def _png_header_only(w, h) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_decompression_bombs_are_refused_before_decoding(tmp_path, shard_kit):
    samples = _samples(shard_kit, 0, 12)
    samples[2][1].pop("jpg")
    samples[2][1]["png"] = _png_header_only(60000, 60000)  # 3.6 G pixels claimed by a 100-byte file
    samples[5][1]["jpg"] = shard_kit.image_bytes(120, 100, seed=5)  # over the 10k-pixel limit below
    root = shard_kit.make_shards(tmp_path / "s", [samples], list("abcd"))
    loader = build_loader(_cfg(root, max_corrupt_rate=0.5, max_image_pixels=10_000), batch_size=5, img_size=16)
    _run(loader, 2)
    assert loader.counters["image_too_large"] == 2


def test_remote_urls_need_allow_remote(tmp_path, shard_kit):
    root = shard_kit.make_shards(tmp_path / "s", [_samples(shard_kit, 10 * k, 10) for k in range(2)], list("abcd"))
    pattern = f"pipe:cat {root}/train-{{000000..000001}}.tar"
    with pytest.raises(DataError, match="remote URL 'pipe:cat .*' needs data.allow_remote=true"):
        build_loader(_cfg(pattern), batch_size=5, img_size=16)
    with pytest.raises(DataError, match="needs data.allow_remote"):
        build_loader(_cfg("https://example.com/shards/manifest.json"), batch_size=5, img_size=16)
    loader = build_loader(_cfg(pattern, allow_remote=True), batch_size=5, img_size=16)  # manifest via pipe: too
    assert [y.shape[0] for _, y in _run(loader, 4)] == [5] * 4 and loader.counters["samples"] == 20


def test_shards_named_twice_are_refused_not_read_once_in_silence(tmp_path, shard_kit):
    """A list reads each shard once an epoch: a set named again (another spelling of its folder, one
    of its shards beside it whole, overlapping brace patterns) would not be weighted as it reads."""
    root = shard_kit.make_shards(tmp_path / "s", [_samples(shard_kit, 10 * k, 10) for k in range(4)], list("abcd"))
    twice = "; each shard is read once an epoch, so naming shards again does not weight them: name each once"
    for spec, said in (
            ([str(root), f"{tmp_path}/s/./manifest.json"], f"{root}/manifest.json is named twice"),
            ([str(root), f"{root}/train-000002.tar"],
             f"{root}/train-000002.tar is named on its own, and within {root}/manifest.json whole too"),
            ([f"{root}/train-000001.tar", f"{root}/"],
             f"{root}/manifest.json is named whole, and its shard train-000001.tar on its own too"),
            (f"{root}/train-{{000000..000002}}.tar,{root}/train-000002.tar".split(","),
             f"{root}/train-000002.tar is named twice")):
        with pytest.raises(DataError) as e:
            build_loader(DataConfig(train_shards=spec, workers=0), batch_size=5, img_size=16)
        assert str(e.value) == f"data.train_shards: {said}{twice}", spec
    # each named once, by any mix of forms: every sample once an epoch
    once = [f"{root}/train-{{000000..000001}}.tar", f"{root}/train-000003.tar"]
    assert build_loader(DataConfig(train_shards=once, workers=0), batch_size=5, img_size=16).plan.shardset.total == 30


def test_manifest_mistakes_are_one_line_data_errors(tmp_path, shard_kit):
    root = shard_kit.make_shards(tmp_path / "s", [_samples(shard_kit, 0, 10)], list("abcd"))
    with pytest.raises(DataError, match="data.train_shards is not set"):
        build_loader(DataConfig(), batch_size=2)
    with pytest.raises(DataError, match=r"/nope/manifest.json: manifest not found"):
        build_loader(_cfg(tmp_path / "nope" / "train-{000000..000003}.tar"), batch_size=2)
    with pytest.raises(DataError, match="shard 'train-000007.tar' is not listed in this manifest"):
        build_loader(_cfg(root / "train-000007.tar"), batch_size=2)
    (root / "train-000000.tar").rename(root / "moved.tar")
    with pytest.raises(DataError, match="no shards match .*none of the 1 files exists"):
        build_loader(_cfg(root), batch_size=2)
    (root / "moved.tar").rename(root / "train-000000.tar")
    m = json.loads((root / "manifest.json").read_text())
    m["total"] = 11
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"manifest.json: total: 11 differs from the sum of shard samples 10"):
        build_loader(_cfg(root), batch_size=2)
    (root / "manifest.json").write_text("{broken")
    with pytest.raises(DataError, match="manifest.json: invalid JSON at line 1"):
        build_loader(_cfg(root), batch_size=2)
    (root / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest not found") as e:
        build_loader(_cfg(root / "train-000000.tar"), batch_size=2)
    assert "\n" not in str(e.value)


def test_manifest_bytes_nesting_and_booleans_are_one_line_data_errors(tmp_path, shard_kit):
    """A manifest that is not UTF-8, one nested past the JSON decoder's recursion, and a bool where
    a count belongs (True is an int to isinstance): each a DataError naming the file, and one line
    with exit 2 from a command that reads it."""
    root = shard_kit.make_shards(tmp_path / "s", [_samples(shard_kit, 0, 1)], list("ab"))
    good = json.loads((root / "manifest.json").read_text())
    bools = [dict(good, shards=[dict(good["shards"][0], samples=True)]), dict(good, total=True)]
    latin1 = b'{"format": "vitscale-shards", "classes": ["\xff"]}'
    cases = [
        (latin1, f"not UTF-8 text (byte 0xff at offset {latin1.index(0xff)})"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
        (json.dumps(bools[0]).encode(), "shards[0]: expected {'name': file name, 'samples': int >= 0}, got "
                                        "{'name': 'train-000000.tar', 'samples': True"),
        (json.dumps(bools[1]).encode(), "total: True differs from the sum of shard samples 1"),
    ]
    manifest = root / "manifest.json"
    for data, said in cases:
        manifest.write_bytes(data)
        with pytest.raises(DataError) as e:
            build_loader(_cfg(root), batch_size=1)
        assert str(e.value).startswith(f"{manifest}: {said}"), e.value
        r = subprocess.run([sys.executable, "-m", "data_pipeline.loading.plan", str(manifest), "--world-size", "1",
                            "--workers", "1", "--batch", "1"], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2])
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr


class _Unseekable(io.RawIOBase):
    """A file read front to back only (as an HTTP body is): read_shard hands it to tarfile whole."""

    def __init__(self, path):
        self.f = open(path, "rb")

    def readable(self):
        return True

    def readinto(self, b):
        return self.f.readinto(b)

    def close(self):
        self.f.close()
        super().close()


def test_tar_reading_is_tarfiles_at_every_cut(tmp_path, shard_kit, monkeypatch):
    """read_shard reads plain regular members itself; what it yields and counts must be what it
    yields and counts when tarfile reads the whole stream: for a shard cut short at many points
    (inside headers, data and padding), shards with pax headers, directories and oversized names
    (which tarfile takes over), a gzip-compressed one, and ranges that skip samples."""
    from data_pipeline.shards import reader
    from data_pipeline.shards.manifest import Shard
    from data_pipeline.tally import Tally

    samples = _samples(shard_kit, 0, 6)
    samples[2][1]["txt"] = b"x" * 512  # data of exactly one block: no padding
    samples[3][1]["pyd"] = b"\x80"  # skipped unread, counted
    plain = tmp_path / "plain.tar"
    shard_kit.write_tar(plain, samples)
    raw = plain.read_bytes()
    files = {}
    for cut in sorted({*range(0, len(raw), 97), *range(500, 530), len(raw) - 1024, len(raw) - 1, len(raw)}):
        files[f"cut{cut}"] = raw[:cut]
    for name, extra in (("pax", "é" * 3), ("long", "d" * 120)):  # a pax header (non-ASCII / long name)
        path = tmp_path / f"{name}.tar"
        shard_kit.write_tar(path, samples[:3] + [(f"00003{extra}", samples[3][1])] + samples[4:])
        files[name] = path.read_bytes()
    with tarfile.open(tmp_path / "dir.tar", "w") as tar:  # a directory member between samples
        for i, (key, members) in enumerate(samples):
            if i == 2:
                d = tarfile.TarInfo("adir")
                d.type = tarfile.DIRTYPE
                tar.addfile(d)
            for ext in sorted(members):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(members[ext])
                tar.addfile(info, io.BytesIO(members[ext]))
    files["dir"] = (tmp_path / "dir.tar").read_bytes()
    files["gz"] = zlib.compressobj(wbits=31).compress(raw) + zlib.compressobj(wbits=31).flush()
    files["garbage"] = raw[:512] + b"\x07" * 3000

    def read(path, ranges, unseekable):
        if unseekable:
            monkeypatch.setattr(reader, "open_shard",
                                lambda url, name, tally, policy: io.BufferedReader(_Unseekable(url)))
        else:
            monkeypatch.undo()
        tally = Tally()
        got = [(s.index, s.key, s.members, s.lost)
               for s in reader.read_shard(Shard(0, "s.tar", str(path), 6), tally, ranges)]
        return got, tally.take()

    for name, data in files.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        for ranges in (None, [(1, 3), (4, 6)]):
            ours, ref = read(path, ranges, False), read(path, ranges, True)
            assert ours == ref, (name, ranges)
    assert read(tmp_path / "cut0.bin", None, False)[1]["counts"].get("truncated_tar") == 1
    assert sum(1 for s in read(tmp_path / "pax.bin", None, False)[0] if not s[3]) == 6
