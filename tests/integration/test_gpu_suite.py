"""`benchmarks/gpu_suite.py --smoke`: the whole GPU suite at toy sizes on CPU, so that it never rots
between GPU runs. Checks that every section ran and produced numbers."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def test_gpu_suite_smoke(tmp_path):
    out = tmp_path / "suite"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "suite.json").read_text())
    rows = result["rows"]
    assert result["smoke"] is True and result["complete"] is True and result["wall_s"] > 0
    by_section = {}
    for row in rows:
        by_section.setdefault(row["section"], []).append(row)
    assert set(by_section) == {"peak", "model", "zero", "loader"}, sorted(by_section)

    (peak,) = by_section["peak"]
    assert peak["status"] == "ok" and _number(peak["measured_tflops"]), peak
    assert result["peak_source"] in ("datasheet", "measured") and _number(result["peak_tflops"])

    variants = [r["variant"] for r in by_section["model"]]
    assert variants == ["timm", "ours", "ours compiled", "ours act-ckpt"], variants
    names = [r["name"] for r in by_section["zero"]]
    assert names == ["ViT-Ti/16 ZeRO-1", "ViT-Ti/16 ZeRO-3", "ViT-Ti/16 ZeRO-3 per-module hooks"], names
    for row in by_section["model"] + by_section["zero"]:
        assert row["status"] == "ok", row
        for key in ("step_ms", "img_s", "tflops", "mfu", "peak_mem_gib"):
            assert _number(row[key]), (key, row)
    ckpt = by_section["model"][3]
    assert ckpt["hfu"] > ckpt["mfu"], ckpt  # checkpointing's recomputed forward counts as hardware FLOPs

    cpu, gpu, dali = by_section["loader"]
    assert cpu["decode"] == "cpu" and cpu["status"] == "ok" and _number(cpu["img_s"]), cpu
    # GPU decode (data.decode_device=cuda) runs its CPU code path in the smoke, DALI its CPU pipeline
    assert gpu["status"] == "ok" and gpu["decode_device"] == "cpu" and _number(gpu["img_s"]), gpu
    assert dali["status"] == "ok" and dali["decode_device"] == "dali" and _number(dali["img_s"]), dali
    assert dali["vs_gpu_decode"] == dali["img_s"] / gpu["img_s"], dali

    md = (out / "suite.md").read_text()
    for row in rows:
        assert row["name"].split(" ")[0] in md
    assert "| ours compiled |" in md and "ZeRO-3" in md and "ShardLoader, CPU decode" in md


def test_failed_row_is_recorded_and_the_rest_goes_on(monkeypatch):
    """An OOM in one variant (here: while compiling, and in a timed step) becomes that row's error;
    the other variants of the group are still measured."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", suite)  # dataclasses look their module up there
    spec.loader.exec_module(suite)
    plan = suite.smoke_plan()
    plan.img, plan.iters = 32, 2

    def oom_compile(model):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    real = suite.Variant.timed_step

    def oom_in_ckpt_step(self, x, y):
        if self.label == "ours act-ckpt":
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, x, y)

    monkeypatch.setattr(suite.Variant, "timed_step", oom_in_ckpt_step)
    rows = {r["variant"]: r for r in suite.run_model_group("vit_tiny_patch16_224", 2, plan, torch.device("cpu"),
                                                           30.0, oom_compile, 1.0, "measured")}
    assert rows["ours compiled"]["status"] == "error" and rows["ours compiled"]["error"].startswith("OOM"), rows
    assert rows["ours act-ckpt"]["status"] == "error" and "OOM" in rows["ours act-ckpt"]["error"], rows
    for v in ("timm", "ours"):
        assert rows[v]["status"] == "ok" and rows[v]["iters"] == 2 and rows[v]["img_s"] > 0, rows[v]


def test_out_of_time_parts_are_skipped_rows(tmp_path, monkeypatch):
    """A suite whose time is spent still writes every row: the parts it could not start say so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", suite)
    spec.loader.exec_module(suite)
    toy = suite.smoke_plan

    def no_time():
        plan = toy()
        plan.total_budget = 0.0
        return plan

    monkeypatch.setattr(suite, "smoke_plan", no_time)
    import torch

    threads = torch.get_num_threads()
    try:
        assert suite.main(["--smoke", "--output", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)  # the smoke sets its own count; leave the test process as it was
    result = json.loads((tmp_path / "suite.json").read_text())
    assert result["complete"] is True
    statuses = [(r["section"], r["status"]) for r in result["rows"]]
    # the peak, four model rows, three ZeRO rows, three loader rows (worker, cuda and DALI decode)
    assert statuses[0] == ("peak", "ok") and len(statuses) == 11, statuses
    assert all(s == "skipped" for _, s in statuses[1:]), statuses
    assert "suite out of time" in (tmp_path / "suite.md").read_text()
