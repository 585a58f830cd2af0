"""The kit for a lent GPU machine (benchmarks/device_kit.py, benchmarks/device_run.sh): what it
would carry, from this environment's installed metadata, and the run script's refusal without it.
(Building the wheels needs the registry; it is rehearsed by hand, see benchmarks/RESULTS.md.)"""
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
