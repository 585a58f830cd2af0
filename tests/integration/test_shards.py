"""Shard writer: round trip for every source kind, manifest, stock webdataset reader, crash safety,
CLI errors, and the numpy-only unpickler used for CIFAR."""
from __future__ import annotations

import io
import json
import pickle
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from shard_utils import InterruptOnce

from data_pipeline.errors import DataError
from data_pipeline.shards import sources
from data_pipeline.shards.cli import main
from data_pipeline.shards.demo_data import PRETRAIN_CLASSES, TRANSFER_CLASSES, demo_items
from data_pipeline.shards.writer import PROGRESS_NAME, write_shards

REPO = Path(__file__).resolve().parents[2]


def _read_stock(out: Path):
    """Read shards with a stock webdataset pipeline (no vitscale code)."""
    urls = [str(out / s["name"]) for s in json.loads((out / "manifest.json").read_text())["shards"]]
    ds = wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("__key__", "jpg;png;webp", "cls")
    return list(ds)


def _check_manifest(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    assert m["total"] == sum(s["samples"] for s in m["shards"])
    for s in m["shards"]:
        assert (out / s["name"]).stat().st_size == s["bytes"]
        with tarfile.open(out / s["name"]) as t:
            keys = {Path(n).stem for n in t.getnames()}
        assert len(keys) == s["samples"], s
    assert not list(out.glob(".*tmp*")) and not (out / PROGRESS_NAME).exists()
    return m


# ------------------------------------------------------------------------------------- demo
def test_demo_shards_manifest_and_stock_reader(demo_train):
    m = _check_manifest(demo_train)
    assert m["classes"] == PRETRAIN_CLASSES and m["total"] == 384 and len(m["shards"]) == 16
    rows = _read_stock(demo_train)
    assert len(rows) == 384 and len({k for k, _, _ in rows}) == 384
    labels = [int(c) for _, _, c in rows]
    assert set(labels) == set(range(10)) and max(labels.count(c) for c in range(10)) <= 39
    sizes = {img.size for _, img, _ in rows}
    assert all(64 <= w <= 96 and 64 <= h <= 96 for w, h in sizes) and len(sizes) > 50


def test_demo_transfer_classes_are_held_out_and_generation_is_deterministic():
    assert not set(PRETRAIN_CLASSES) & set(TRANSFER_CLASSES)
    _, a = demo_items("transfer-test", 4)
    _, b = demo_items("transfer-test", 4)
    _, c = demo_items("transfer-train", 4)
    assert np.array_equal(np.asarray(a[3].load()), np.asarray(b[3].load()))
    assert not np.array_equal(np.asarray(a[3].load()), np.asarray(c[3].load()))


def test_cli_demo_transfer_split(tmp_path, capsys):
    assert main(["--source", "demo-transfer", "--split", "test", "--output", str(tmp_path),
                 "--limit", "30", "--shard-size", "8", "--quiet"]) == 0
    m = _check_manifest(tmp_path)
    assert m["classes"] == TRANSFER_CLASSES and m["total"] == 30 and len(m["shards"]) == 4
    assert m["shards"][0]["name"] == "transfer-test-000000.tar"
    assert "30 samples in 4 shards" in capsys.readouterr().out


# ------------------------------------------------------------------------------ imagefolder
def _solid(w, h, rgb, fmt):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), rgb).save(buf, fmt)
    return buf.getvalue()


def test_imagefolder_roundtrip_resize_formats_and_skips(tmp_path, capsys):
    colours = {"cat": (220, 20, 20), "dog": (20, 220, 20), "eel": (20, 20, 220)}
    root = tmp_path / "images"
    for i, (name, rgb) in enumerate(colours.items()):
        (root / name / "sub").mkdir(parents=True)
        (root / name / "a.jpg").write_bytes(_solid(120, 80, rgb, "JPEG"))  # resized to 48 shorter
        (root / name / "b.png").write_bytes(_solid(40, 30, rgb, "PNG"))  # small: copied as png
        (root / name / "sub" / "c.webp").write_bytes(_solid(30, 40, rgb, "WEBP"))
    (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (root / "eel" / "notes.txt").write_text("ignored: not an image extension")
    out = tmp_path / "shards"
    assert main(["--source", f"imagefolder:{root}", "--output", str(out), "--shard-size", "4",
                 "--resize-shorter", "48", "--quiet"]) == 0
    m = _check_manifest(out)
    assert m["classes"] == ["cat", "dog", "eel"] and m["total"] == 9 and m["skipped"] == {"unreadable": 1}
    assert m["skipped_files"] == {"unreadable": ["dog/broken.jpg"]}  # named, relative to the root
    err = capsys.readouterr().err
    assert err == (f'vit-shards: skipped 1 file (unreadable: 1): dog/broken.jpg; all names under '
                   f'"skipped_files" in {out / "manifest.json"}\n')
    assert [s["samples"] for s in m["shards"]] == [4, 4, 1]
    exts = set()
    for url in (out / s["name"] for s in m["shards"]):
        for s in wds.WebDataset(str(url), shardshuffle=False):
            ext = next(e for e in ("jpg", "png", "webp") if e in s)
            exts.add(ext)
            img = Image.open(io.BytesIO(s[ext])).convert("RGB")
            assert min(img.size) <= 48
            label = int(s["cls"])
            mean = np.asarray(img, np.float32).mean((0, 1))
            assert np.abs(mean - colours[m["classes"][label]]).max() < 12, (label, mean)
    assert exts == {"jpg", "png", "webp"}


def test_truncated_file_stored_as_it_comes_is_skipped_and_counted(tmp_path, capsys):
    """A JPEG small enough to be stored as it comes, cut short (a partial copy, a full disk): its
    header parses, its pixels do not. The writer decodes it, skips it and says so; the loader then
    meets no corrupt sample in the first epoch."""
    from data_pipeline.config import DataConfig
    from data_pipeline.loading.loader import build_loader

    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(4):
            buf = io.BytesIO()  # noise: a JPEG of many bytes past its header
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
            (root / name / f"{i}.jpg").write_bytes(buf.getvalue())
    whole = (root / "dog" / "3.jpg").read_bytes()
    (root / "dog" / "3.jpg").write_bytes(whole[:len(whole) * 3 // 4])
    Image.open(root / "dog" / "3.jpg")  # the header alone reads fine
    out = tmp_path / "shards"
    assert main(["--source", f"imagefolder:{root}", "--output", str(out), "--shard-size", "4", "--quiet"]) == 0
    m = _check_manifest(out)
    assert m["total"] == 7 and m["skipped"] == {"unreadable": 1}, m["skipped"]
    assert m["skipped_files"] == {"unreadable": ["dog/3.jpg"]}
    o, err = capsys.readouterr()
    assert "7 samples in 2 shards" in o and o.rstrip().endswith("; skipped {'unreadable': 1}"), o
    assert "skipped 1 file (unreadable: 1): dog/3.jpg" in err, err
    loader = build_loader(DataConfig(train_shards=str(out), workers=0, shuffle_buffer=4), batch_size=7, img_size=32)
    next(iter(loader))
    assert loader.counters == {"samples": 7}, loader.counters  # the whole epoch, nothing corrupt


def _fails_one_line(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("vit-shards: error: "), err
    return err.strip()


def test_empty_class_folder_is_an_error_unless_allowed(tmp_path, capsys):
    root = tmp_path / "images"
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        (root / name / "a.png").write_bytes(_solid(20, 20, (200, 10, 10), "PNG"))
    (root / "cow").mkdir()  # a typo'd or unsynced class: no images
    (root / "cow" / "notes.txt").write_text("not an image")
    out = tmp_path / "shards"
    argv = ["--source", f"imagefolder:{root}", "--output", str(out), "--quiet"]
    err = _fails_one_line(argv, capsys)
    assert f"{root / 'cow'}: class folder holds no images" in err and "--allow-empty-classes" in err
    assert not out.exists()  # checked before anything is written
    (root / "emu").mkdir()
    assert "(and 1 more: emu)" in _fails_one_line(argv, capsys)

    assert main(argv + ["--allow-empty-classes"]) == 0
    m = _check_manifest(out)
    assert m["classes"] == ["cat", "cow", "dog", "emu"] and m["total"] == 2
    assert sorted(int(c) for _, _, c in _read_stock(out)) == [0, 2]


def test_shards_written_into_the_image_folder_are_refused(tmp_path, capsys):
    """Inside --source, the next run over the folder would read the shards' folder as a class."""
    root = tmp_path / "images"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "a.png").write_bytes(_solid(20, 20, (200, 10, 10), "PNG"))
    for out in (root / "shards", root, root / "cat" / "shards"):
        err = _fails_one_line(["--source", f"imagefolder:{root}", "--output", str(out), "--quiet"], capsys)
        assert f"--output {out} is inside --source imagefolder:{root}" in err, err
        assert not (out / "manifest.json").exists() and not (root / "shards").exists()
    assert main(["--source", f"imagefolder:{root}", "--output", str(tmp_path / "images-shards"),
                 "--quiet"]) == 0  # beside it: a name that starts like the folder's is not inside it


def test_unreadable_files_are_named_capped_and_survive_resume(tmp_path, capsys, monkeypatch):
    from data_pipeline.shards import writer as ws

    monkeypatch.setattr(ws, "SKIPPED_NAMES", 3)
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    for i in range(4):
        (root / "a" / f"ok{i}.png").write_bytes(_solid(16, 16, (10, 200, 10), "PNG"))
    for i in range(5):
        (root / "a" / f"bad{i}.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    out = tmp_path / "shards"
    assert main(["--source", f"imagefolder:{root}", "--output", str(out), "--no-shuffle", "--shard-size", "2",
                 "--quiet"]) == 0
    m = _check_manifest(out)
    assert m["total"] == 4 and m["skipped"] == {"unreadable": 5}
    assert m["skipped_files"] == {"unreadable": ["a/bad0.jpg", "a/bad1.jpg", "a/bad2.jpg"]}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipped 5 files (unreadable: 5): a/bad0.jpg, a/bad1.jpg, a/bad2.jpg, ..." in err
    assert "the first 3 of each kind" in err

    # an interrupted job keeps the names found before the interruption
    items = sources.imagefolder(str(root)).items
    src = sources.Source("imagefolder:x", ["a"], [InterruptOnce(it) if i == 7 else it for i, it in enumerate(items)])
    with pytest.raises(KeyboardInterrupt):
        write_shards(src, tmp_path / "re", shuffle_seed=None, shard_size=2, progress=False)
    m2 = write_shards(src, tmp_path / "re", shuffle_seed=None, shard_size=2, progress=False)
    assert m2["skipped"] == m["skipped"] and m2["skipped_files"] == m["skipped_files"]


@pytest.mark.parametrize("bad, line", [("-1", 3), ("abc", 4), ("+2", 2)])
def test_filelist_mixed_or_negative_labels_name_the_line(tmp_path, capsys, shard_kit, bad, line):
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(4):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(shard_kit.image_bytes(16, 16, seed=i))
        rows.append(f"img/{i}.jpg\t{i % 3}")
    rows[line - 1] = f"img/{line - 1}.jpg\t{bad}"
    lst = tmp_path / "list.tsv"
    lst.write_text("\n".join(rows) + "\n")
    out = tmp_path / "shards"
    err = _fails_one_line(["--source", f"filelist:{lst}", "--output", str(out), "--quiet"], capsys)
    assert f"{lst}:{line}: label {bad!r}" in err and not out.exists()
    # names with one integer among them: the integer is the odd one out
    lst.write_text("img/0.jpg\tcat\nimg/1.jpg\tdog\nimg/2.jpg\t7\n")
    err = _fails_one_line(["--source", f"filelist:{lst}", "--output", str(out), "--quiet"], capsys)
    assert f"{lst}:3: label '7' is an integer but the other labels are names" in err


# ---------------------------------------------------------------------------------- CIFAR
class _Py2Pickler(pickle._Pickler):
    """Writes pickles the way Python 2's cPickle wrote the official CIFAR files: protocol 2, every
    string a py2 ``str`` (BINSTRING opcodes), numpy's ``_reconstruct`` under numpy.core."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str
    dispatch[str] = save_py2_str

    def save_global(self, obj, name=None):
        if getattr(obj, "__name__", "") == "_reconstruct":
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _py2_dump(obj) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    base = tmp_path_factory.mktemp("cifar")
    folder = base / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 12), ("test", 6)):
        pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 100, n)]
        arrays[split] = (pixels, labels)
        (folder / split).write_bytes(_py2_dump({
            b"filenames": [f"img_{i}.png".encode() for i in range(n)], b"batch_label": b"training batch 1 of 1",
            b"fine_labels": labels, b"coarse_labels": [x // 5 for x in labels], b"data": pixels}))
    fine = [f"class_{i:02d}".encode() for i in range(100)]
    (folder / "meta").write_bytes(_py2_dump({b"fine_label_names": fine,
                                             b"coarse_label_names": [f"super_{i}".encode() for i in range(20)]}))
    tgz = base / "cifar-100-python.tar.gz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(folder, arcname="cifar-100-python")
    return base, tgz, arrays


@pytest.mark.parametrize("form", ["folder", "tar.gz"])
def test_cifar100_roundtrip(cifar, tmp_path, form):
    base, tgz, arrays = cifar
    path = base if form == "folder" else tgz  # the parent of cifar-100-python works too
    out = tmp_path / "c100"
    assert main(["--source", f"cifar100:{path}", "--split", "test", "--output", str(out), "--no-shuffle",
                 "--quality", "100", "--quiet"]) == 0
    m = _check_manifest(out)
    assert m["classes"] == [f"class_{i:02d}" for i in range(100)] and m["total"] == 6
    pixels, labels = arrays["test"]
    rows = _read_stock(out)
    assert [int(c) for _, _, c in rows] == labels
    for (_, img, _), flat in zip(rows, pixels):
        ref = flat.reshape(3, 32, 32).transpose(1, 2, 0).astype(np.float32)
        assert np.abs(np.asarray(img, np.float32) - ref).mean() < 12  # JPEG q100 of noise


def test_safe_load_pickle_reads_official_layout_and_refuses_code(cifar, tmp_path):
    base, _, arrays = cifar
    d = sources.safe_load_pickle(base / "cifar-100-python" / "train")
    assert np.array_equal(d[b"data"], arrays["train"][0]) and d[b"fine_labels"] == arrays["train"][1]

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(marker)],))

    payload = pickle.dumps({"data": Evil()})
    with pytest.raises(pickle.UnpicklingError, match="subprocess.call"):
        sources.safe_load_pickle(io.BytesIO(payload))
    assert not marker.exists()
    bad = base / "evil"
    (bad / "cifar-100-python").mkdir(parents=True)
    (bad / "cifar-100-python" / "train").write_bytes(payload)
    (bad / "cifar-100-python" / "meta").write_bytes((base / "cifar-100-python" / "meta").read_bytes())
    with pytest.raises(DataError, match="refusing to unpickle subprocess.call"):
        sources.cifar100(str(bad), "train")
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: a plain unpickler runs it
    assert marker.exists()


# -------------------------------------------------------------------------------- filelist
def test_filelist_multilabel(tmp_path, shard_kit):
    (tmp_path / "img").mkdir()
    lines = []
    labels = [["tree", "sky"], ["car"], ["sky", "car", "road"], ["tree"]]
    for i, labs in enumerate(labels):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(shard_kit.image_bytes(16, 16, seed=i))
        lines.append(f"img/{i}.jpg\t{','.join(labs)}")
    (tmp_path / "list.tsv").write_text("# path<TAB>labels\n" + "\n".join(lines) + "\n")
    out = tmp_path / "shards"
    assert main(["--source", f"filelist:{tmp_path / 'list.tsv'}", "--output", str(out), "--no-shuffle",
                 "--quiet"]) == 0
    m = _check_manifest(out)
    assert m["multi_label"] is True and m["classes"] == ["car", "road", "sky", "tree"]
    got = [(json.loads(s["json"])["labels"], int(s["cls"])) for s in wds.WebDataset(str(out / m["shards"][0]["name"]),
                                                                                     shardshuffle=False)]
    want = [[m["classes"].index(x) for x in labs] for labs in labels]
    assert got == [(w, w[0]) for w in want]


# ---------------------------------------------------------------------------- crash safety


def test_interrupted_write_is_finished_by_rerun(tmp_path):
    classes, items = demo_items("val", 40)
    ref = tmp_path / "ref"
    write_shards(sources.Source("demo:val", classes, items), ref, split="val", shard_size=8, progress=False)

    out = tmp_path / "out"
    order = list(range(40))
    import random
    random.Random(0).shuffle(order)
    wrapped = list(items)
    wrapped[order[21]] = InterruptOnce(items[order[21]])  # the 22nd sample written: shard 2 is half done
    src = sources.Source("demo:val", classes, wrapped)
    with pytest.raises(KeyboardInterrupt):
        write_shards(src, out, split="val", shard_size=8, progress=False)
    assert not (out / "manifest.json").exists() and not list(out.glob(".*.tmp-*"))
    assert sorted(p.name for p in out.glob("*.tar")) == ["val-000000.tar", "val-000001.tar"]
    assert len(json.loads((out / PROGRESS_NAME).read_text())["shards"]) == 2
    (out / ".val-000002.tar.tmp-99999").write_bytes(b"half a shard left by kill -9")

    with pytest.raises(DataError, match="another source or options"):
        write_shards(src, out, split="val", shard_size=10, progress=False)
    m = write_shards(src, out, split="val", shard_size=8, progress=False)  # rerun: finishes the job
    assert m == _check_manifest(out) and m["total"] == 40
    for s in m["shards"]:
        assert (out / s["name"]).read_bytes() == (ref / s["name"]).read_bytes()
    assert write_shards(src, out, split="val", shard_size=8, progress=False) == m  # idempotent


# ------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv, needle", [
    (["--source", "imagefolder:/does/not/exist", "--output", "X"], "/does/not/exist: not found"),
    (["--source", "tfrecords:/x", "--output", "X"], "unknown kind 'tfrecords'"),
    (["--source", "cifar100:", "--output", "X"], "missing path"),
    (["--source", "demo", "--split", "test", "--output", "X"], "--split test"),
    (["--source", "demo", "--output", "X", "--quality", "101"], "--quality"),
    (["--source", "demo", "--output", "X", "--shard-size", "0"], "--shard-size"),
    (["--source", "demo"], "--output"),
    # the split starts every shard's file name: a path there failed on the writer's temporary file
    (["--source", "demo", "--output", "X", "--split", "x/y"], "--split: 'x/y' is not a shard name prefix"),
    (["--source", "demo", "--output", "X", "--split", ""], "--split: '' is not a shard name prefix"),
    (["--source", "demo", "--output", "X", "--split", ".val"], "--split: '.val' is not a shard name prefix"),
])
def test_cli_errors_are_one_line_exit_2(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and needle in err and err.startswith("vit-shards: error:")
    assert not (tmp_path / "X").exists()  # nothing written


def test_python_m_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "data_pipeline.write_shards", "--source", f"filelist:{tmp_path}/no.tsv",
                        "--output", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"vit-shards: error: {tmp_path}/no.tsv: not found " \
                                                     f"(--source filelist:{tmp_path}/no.tsv)"


def test_parallel_writer_matches_serial_and_respects_max_bytes(tmp_path):
    classes, items = demo_items("val", 24)
    src = sources.Source("demo:val", classes, items)
    serial = write_shards(src, tmp_path / "serial", split="val", max_shard_bytes=20_000, progress=False)
    parallel = write_shards(src, tmp_path / "parallel", split="val", max_shard_bytes=20_000, workers=2,
                            progress=False)
    assert serial["shards"] == parallel["shards"] and len(serial["shards"]) >= 4
    for s in serial["shards"]:
        assert (tmp_path / "serial" / s["name"]).read_bytes() == (tmp_path / "parallel" / s["name"]).read_bytes()
        with tarfile.open(tmp_path / "serial" / s["name"]) as t:
            assert sum(512 + -(-m.size // 512) * 512 for m in t.getmembers()) <= 20_000
