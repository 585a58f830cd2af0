"""The kit for a GPU machine without network (benchmarks/device_kit.py, benchmarks/device_run.sh):
what it would carry, from this environment's installed metadata, and the run script's refusal
without it. (Building the wheels needs the package registry, so no test builds them.)"""
import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _kit(monkeypatch):
    spec = importlib.util.spec_from_file_location("device_kit", ROOT / "benchmarks" / "device_kit.py")
    kit = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "device_kit", kit)
    spec.loader.exec_module(kit)
    return kit


def test_closure_pins_what_training_imports_and_leaves_the_image_alone(monkeypatch):
    kit = _kit(monkeypatch)
    pins = dict(p.split("==") for p in kit.closure(kit.ROOTS, "3.12"))
    # the roots and requirements the image lacks, each at the version installed here
    for name in ("deepspeed", "webdataset", "wandb", "hjson", "pydantic", "pydantic-core", "braceexpand"):
        assert pins[name] == metadata.version(name), name
    # the large packages the image has are never carried
    assert not {"torch", "torchvision", "triton", "numpy", "pillow"} & set(pins)
    assert not [n for n in pins if n.startswith("nvidia-")]


def test_run_script_without_the_kit_is_one_line(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh"), "suite"], cwd=ROOT, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "KIT": str(tmp_path / "none"), "OUT": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "requirements.txt missing" in r.stderr and "make device-kit" in r.stderr


def test_parts_join_into_the_archive_they_were_cut_from_and_name_what_is_missing(monkeypatch, tmp_path):
    """The DALI kit travels in parts: joined, they unpack to the files archived; a part not carried
    yet or carried damaged is named, and nothing is unpacked then."""
    import tarfile

    kit = _kit(monkeypatch)
    src = tmp_path / "src"
    src.mkdir()
    files = {"a-1.0-py3-none-any.whl": bytes(range(256)) * 40, "requirements.txt": b"a==1.0\n"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    archive = tmp_path / "kit.tar"
    with tarfile.open(archive, "w") as t:
        for name in files:
            t.add(src / name, arcname=name)
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    parts = kit.split(archive, parts_dir, part_bytes=4096)
    assert len(parts) == -(-archive.stat().st_size // 4096) > 2
    assert all(p.stat().st_size <= 4096 for p in parts)
    assert kit.join(parts_dir, tmp_path / "out") is None
    assert {n: (tmp_path / "out" / n).read_bytes() for n in files} == files
    assert not (tmp_path / "out" / "kit.tar").exists()

    parts[1].rename(tmp_path / "aside")
    why = kit.join(parts_dir, tmp_path / "out2")
    assert "1 of" in why and "part-02" in why and not (tmp_path / "out2").exists()
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh"), "carry"], cwd=ROOT, capture_output=True,
                       text=True, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PY": sys.executable,
                                       "NVKIT": str(parts_dir), "OUT": str(tmp_path / "run")})
    assert r.returncode == 0 and "part-02" in r.stdout and "not carried yet" in r.stdout, r.stdout + r.stderr
    (tmp_path / "aside").rename(parts[1])
    parts[0].write_bytes(b"x" + parts[0].read_bytes()[1:])
    why = kit.join(parts_dir, tmp_path / "out3")
    assert "SHA-256 differs" in why and "part-01" in kit.join(parts_dir, tmp_path / "o")
