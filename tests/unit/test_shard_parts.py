"""Shards written in parts (``vit-shards --part I/N``, one per machine) and joined by
``vit-shards merge``: the same samples, labels and keys as one process, parts rerun alone, and
every missing or inconsistent part refused in one line."""
from __future__ import annotations

import io
import json
import os

import pytest
from PIL import Image
from shard_utils import samples_of

from data_pipeline.shards.cli import main
from data_pipeline.shards.manifest import resolve_shards
from data_pipeline.shards.parts import part_range

SHARD = ["--shard-size", "4", "--resize-shorter", "24", "--quiet"]


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32 + i % 5, 30), (i * 37 % 256, i * 91 % 256, i * 13 % 256)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes, 41 images (one larger than --resize-shorter, so re-encoded), 2 unreadable files."""
    root = tmp_path_factory.mktemp("parts") / "images"
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
    for i in range(41):
        (root / f"c{i % 3}" / f"{i:03d}.jpg").write_bytes(_jpeg(i))
    (root / "c1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    (root / "c2" / "empty.png").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def one_and_parts(folder, tmp_path_factory):
    """The job written by one process, and as 4 parts (run out of order, one with 2 workers) + merge."""
    base = tmp_path_factory.mktemp("written")
    one, parts = base / "one", base / "parts"
    src = ["--source", f"imagefolder:{folder}"]
    assert main([*src, "--output", str(one), *SHARD]) == 0
    for i in (3, 1, 4, 2):
        assert main([*src, "--output", str(parts), *SHARD, "--part", f"{i}/4",
                     *(["--workers", "2"] if i == 4 else [])]) == 0
    assert not (parts / "manifest.json").exists()  # only merge writes it
    assert main(["merge", str(parts), *map(str, sorted(parts.glob("part-*.json")))]) == 0
    return one, parts


def test_merged_parts_equal_one_process(one_and_parts):
    one, parts = one_and_parts
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (one, parts))
    assert b["parts"] == 4 and a["job"] == b["job"] and a["options"] == b["options"]
    for k in ("classes", "total", "skipped", "source", "multi_label"):
        assert a[k] == b[k], k
    assert a["total"] == 41 and a["skipped"] == {"unreadable": 2}
    assert sorted(sum(b["skipped_files"].values(), [])) == ["c1/broken.jpg", "c2/empty.png"]
    assert samples_of(one) == samples_of(parts)  # same keys, image bytes, labels
    names = [s["name"] for s in b["shards"]]
    assert names[0] == "train-0001of0004-000000.tar" and names == sorted(names)
    # the loader reads the merged manifest like any other, keys increasing through it
    ss = resolve_shards(str(parts))
    assert ss.total == 41 and ss.num_classes == 3 and len(ss.shards) == len(names)


def test_part_ranges_cover_the_job_in_whole_nominal_shards():
    for n, size, parts in ((43, 4, 4), (10, 4, 5), (1000, 7, 3), (5, 16, 3)):
        ranges = [part_range(n, size, (i, parts)) for i in range(1, parts + 1)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(lo % size == 0 for lo, _ in ranges)
    assert part_range(5, 16, (1, 3)) == (0, 0) and part_range(5, 16, (3, 3)) == (0, 5)  # parts may be empty


def test_rerun_part_rewrites_only_that_part(folder, tmp_path):
    out = tmp_path / "out"
    src = ["--source", f"imagefolder:{folder}", "--output", str(out), *SHARD]
    for i in (1, 2, 3):
        assert main([*src, "--part", f"{i}/3"]) == 0
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    again = {p.name for p in out.glob("train-0002of0003-*.tar")} | {"part-0002of0003.json"}
    # part 2's machine died: its part manifest never came, a half-written shard of it is left, while
    # part 3 is (as far as this machine knows) still writing one
    (out / "part-0002of0003.json").unlink()
    (out / ".train-0002of0003-000001.tar.tmp-999").write_bytes(b"half")
    (out / ".train-0003of0003-000002.tar.tmp-998").write_bytes(b"other machine")
    old = {n: (out / n).read_bytes() for n in again if n.endswith(".tar")}
    for n in old:
        (out / n).unlink()
    assert main([*src, "--part", "2/3"]) == 0
    assert {n: (out / n).read_bytes() for n in old} == old  # the same shards again
    assert not (out / ".train-0002of0003-000001.tar.tmp-999").exists()
    assert (out / ".train-0003of0003-000002.tar.tmp-998").exists()  # another part's file: untouched
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir() if not p.name.startswith(".")}
    assert {n for n in after if after[n] != before.get(n)} == again
    # a finished part rerun does nothing
    assert main([*src, "--part", "2/3"]) == 0
    assert (out / "part-0002of0003.json").stat().st_mtime_ns == after["part-0002of0003.json"][1]


def _merge_fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(["merge", *map(str, argv)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("vit-shards merge: error: "), err
    return err.strip()


def test_merge_refuses_missing_duplicate_and_foreign_parts(folder, tmp_path, capsys):
    out = tmp_path / "out"
    src = ["--source", f"imagefolder:{folder}", "--output", str(out), *SHARD]
    for i in (1, 2, 3):
        assert main([*src, "--part", f"{i}/3"]) == 0
    p1, p2, p3 = (out / f"part-000{i}of0003.json" for i in (1, 2, 3))
    capsys.readouterr()
    assert "part 2 of 3 is missing (part-0002of0003.json" in _merge_fails([out, p1, p3], capsys)
    assert f"{p2.with_name('nope.json')}: part manifest not found" in _merge_fails(
        [out, p1, p2.with_name("nope.json"), p3], capsys)
    dup = tmp_path / "copy.json"
    dup.write_text(p1.read_text())
    assert f"{dup}: part 1 of 3 is also given as {p1}" in _merge_fails([out, p1, dup, p2, p3], capsys)
    # a part of another job (another --shard-size) in the same folder
    other = tmp_path / "other"
    assert main(["--source", f"imagefolder:{folder}", "--output", str(other), "--shard-size", "5",
                 "--resize-shorter", "24", "--quiet", "--part", "2/3"]) == 0
    capsys.readouterr()
    err = _merge_fails([out, p1, other / "part-0002of0003.json", p3], capsys)
    assert f"{other / 'part-0002of0003.json'}: job differs from that of {p1}" in err
    # a shard lost or cut short on the shared disk
    shard = out / json.loads(p3.read_text())["shards"][0]["name"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-512])
    assert f"{shard}: shard of part 3 ({p3}) is {len(data) - 512} bytes, written as {len(data)}" in _merge_fails(
        [out, p1, p2, p3], capsys)
    shard.unlink()
    assert f"{shard}: shard of part 3 ({p3}) is missing" in _merge_fails([out, p1, p2, p3], capsys)
    shard.write_bytes(data)
    not_part = out / "x.json"
    not_part.write_text("{\"format\": \"vitscale-shards\", \"version\": 1}")
    assert f"{not_part}: not a part manifest" in _merge_fails([out, not_part], capsys)
    assert not (out / "manifest.json").exists()
    assert main(["merge", str(out), str(p3), str(p1), str(p2)]) == 0  # any order
    assert json.loads((out / "manifest.json").read_text())["total"] == 41


@pytest.mark.parametrize("bad", ["0/3", "4/3", "3", "a/b"])
def test_bad_part_is_one_line(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["--source", "demo", "--output", str(tmp_path / "o"), "--part", bad, "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--part" in err and repr(bad) in err, err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ vit-launch slurm --shards
def _launch(argv, capsys):
    from launch.cli import main as vit_launch

    with pytest.raises(SystemExit) as e:
        vit_launch(["slurm", *map(str, argv)])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_slurm_shards_writes_array_and_merge_scripts(tmp_path, capsys):
    """The scripts themselves run under the real SLURM in tests/cluster/test_shard_array.py."""
    script = tmp_path / "in21k.sbatch"
    code, out, err = _launch(["--shards", "--parts", "64", "--max-running", "8", "--cpus-per-node", "4",
                              "--partition", "cpu", "--time", "2:00:00", "--log-dir", tmp_path / "logs",
                              "--output", script, "--", "--source", "imagefolder:/data/in21k", "--output",
                              "/shards/in21k", "--resize-shorter", "320"], capsys)
    assert code == 0, err
    text, merge = script.read_text(), (tmp_path / "in21k.merge.sbatch").read_text()
    for line in ("#SBATCH --array=1-64%8", "#SBATCH --cpus-per-task=4", "#SBATCH --partition=cpu",
                 "#SBATCH --time=2:00:00", f"#SBATCH --output={tmp_path}/logs/%x-%A_%a.out", "  --workers 4",
                 "  --resize-shorter 320", '--part "$SLURM_ARRAY_TASK_ID/64" --quiet'):
        assert line in text, line
    assert "#SBATCH --array" not in merge and "#SBATCH --partition=cpu" in merge and "merge \"$OUT\"" in merge
    assert "printf 'part-%04dof%04d.json' \"$i\" 64" in merge and "OUT=/shards/in21k" in merge
    assert os.access(script, os.X_OK) and (tmp_path / "logs").is_dir()
    assert f"sbatch --dependency=afterok:$(sbatch --parsable {script})" in out


@pytest.mark.parametrize("theirs, says", [
    (["--source", "demo"], "vit-shards: error: the following arguments are required: --output"),
    (["--source", "demo", "--output", "o", "--part", "1/2"], "the vit-shards options name --part"),
    ([], "give vit-shards' options after `--`"),
])
def test_slurm_shards_checks_the_vit_shards_options(tmp_path, capsys, theirs, says):
    code, _, err = _launch(["--shards", "--parts", "2", "--output", tmp_path / "s.sbatch", "--", *theirs], capsys)
    assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "s.sbatch").exists()


@pytest.mark.parametrize("data, said", [
    (b'{"format": "vitscale-shards-part", "split": "caf\xe9"}', "invalid JSON: 'utf-8' codec can't decode byte 0xe9"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid JSON: maximum recursion depth exceeded"),
])
def test_merge_refuses_undecodable_part_manifests_in_one_line(tmp_path, capsys, data, said):
    """A part manifest that is not UTF-8 or nests past the JSON decoder's recursion is named in one
    line, as any other file that is not a part manifest."""
    (tmp_path / "out").mkdir()
    bad = tmp_path / "out" / "part-0001of0001.json"
    bad.write_bytes(data)
    assert f"{bad}: not a part manifest ({said}" in _merge_fails([tmp_path / "out", bad], capsys)


def _rerun_fails(argv, capsys) -> str:
    capsys.readouterr()  # what earlier commands said
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("vit-shards: error: "), err
    return err.strip().removeprefix("vit-shards: error: ")


def test_a_finished_job_whose_shards_changed_says_what_rewrites_them(folder, tmp_path, capsys):
    """A rerun of a finished job or part returns its manifest, as long as every shard it lists is
    there with the size written; a shard lost or cut short since is one line naming it and what
    writes it again, and doing that gives the job's shards back, byte for byte."""
    out = tmp_path / "out"
    src = ["--source", f"imagefolder:{folder}", "--output", str(out), *SHARD]
    for i in (1, 2, 3):
        assert main([*src, "--part", f"{i}/3"]) == 0
    p3 = out / "part-0003of0003.json"
    shard = out / json.loads(p3.read_text())["shards"][0]["name"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-512])
    capsys.readouterr()
    assert _rerun_fails([*src, "--part", "3/3"], capsys) == (
        f"{shard}: {len(data) - 512} bytes, written as {len(data)} since the job finished; remove {p3} and rerun "
        "with --part 3/3 to write it again")
    p3.unlink()
    assert main([*src, "--part", "3/3"]) == 0 and shard.read_bytes() == data
    assert main(["merge", str(out), *map(str, sorted(out.glob("part-*.json")))]) == 0
    # after the merge: the job's manifest.json is what a rerun of any part finds first
    shard = out / json.loads((out / "part-0002of0003.json").read_text())["shards"][1]["name"]
    data, before = shard.read_bytes(), samples_of(out)
    shard.unlink()
    assert _rerun_fails([*src, "--part", "3/3"], capsys) == (
        f"{shard}: missing since the job finished; remove {out / 'manifest.json'} and "
        f"{out / 'part-0002of0003.json'} and rerun with --part 2/3 to write it again, then vit-shards merge")
    (out / "manifest.json").unlink()
    (out / "part-0002of0003.json").unlink()
    assert main([*src, "--part", "2/3"]) == 0 and shard.read_bytes() == data
    assert main(["merge", str(out), *map(str, sorted(out.glob("part-*.json")))]) == 0
    assert samples_of(out) == before
    # one process's job
    one = tmp_path / "one"
    src = ["--source", f"imagefolder:{folder}", "--output", str(one), *SHARD]
    assert main(src) == 0
    shard = one / json.loads((one / "manifest.json").read_text())["shards"][-1]["name"]
    data = shard.read_bytes()
    shard.write_bytes(b"\0" * (len(data) + 512))
    assert _rerun_fails(src, capsys) == (f"{shard}: {len(data) + 512} bytes, written as {len(data)} since the job "
                                         f"finished; remove {one / 'manifest.json'} and rerun to write it again")
    (one / "manifest.json").unlink()
    assert main(src) == 0 and shard.read_bytes() == data
