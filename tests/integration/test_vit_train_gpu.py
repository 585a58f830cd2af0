"""The GPU measurement of vit-train's own path (benchmarks/vit_train_gpu.py), rehearsed at toy
sizes on the CPU: every row is a real vit-train process on a shipped config with synthetic
batches, its metrics read back, the levers decided as training decides them, and the plain
PyTorch reference in a process of its own. No figure here means anything; the code paths do."""
import json
import subprocess
import sys

import pytest
from dist_utils import REPO, job_env

pytestmark = pytest.mark.slow


def test_vit_train_gpu_smoke(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/vit_train_gpu.py", "--smoke", "--output", str(tmp_path)],
                       cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "vit_train_gpu.json").read_text())
    rows = {row["lever"]: row for row in result["rows"]}
    assert set(rows) == {"shipped", "no-ckpt", "schedule", "plain"}, rows
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert rows["shipped"]["checkpointed_blocks"] == 12  # train.activation_checkpointing=true: every block
    assert rows["no-ckpt"]["checkpointed_blocks"] == 0  # auto on a CPU: none
    assert rows["no-ckpt"]["reduce_bucket_size"] < 5_000_000 <= rows["shipped"]["reduce_bucket_size"]
    for row in rows.values():
        assert row["img_per_s"] > 0 and row["path"] in ("vit-train", "plain PyTorch"), row
        assert row["device"] == result["device"] == "cpu", row  # a row read alone still says where it ran
    # the plain reference is the same job as the rows (the config's model and loss), one step of it profiled
    plain = rows["plain"]
    assert plain["config"] == "configs/tiny_cpu.yaml" and plain["micro_batch"] == rows["shipped"]["micro_batch"]
    # the plain step and one vit-train step (logging.profile) profiled alike, the profiled window left out
    for row in (plain, rows["no-ckpt"]):
        p = row["profile"]
        assert any(a.startswith("aten::_scaled_dot_product_") for a in p["attention"]), row
        assert p["steps"] == 1 and 0 < p["busy_share"] <= 1 and p["ms_per_step"] > 0, p
        assert p["top"] and all(t["ms_per_step"] > 0 for t in p["top"]), p
    metrics = [json.loads(x) for x in (tmp_path / "tiny_cpu-no-ckpt-metrics.jsonl").read_text().splitlines()]
    assert [m.get("profiled_steps") for m in metrics if "images_per_sec" in m] == [None, 1]
    assert rows["no-ckpt"]["windows"] == 1 and rows["shipped"]["windows"] == 1
    # each vit-train row's own metrics, copied beside the JSON, hold the windows it was measured on
    metrics = [json.loads(x) for x in (tmp_path / "tiny_cpu-shipped-metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "images_per_sec" in m] == [2, 4]
    # train.resolution_schedule's row: each phase's windows apart, read back by the img_size they logged
    phases = rows["schedule"]["phases"]
    assert set(phases) == {"32", "48", "64"} and all(p["windows"] >= 1 and p["images_per_sec"] > 0
                                                   for p in phases.values()), phases
    metrics = [json.loads(x) for x in (tmp_path / "tiny_cpu-schedule-metrics.jsonl").read_text().splitlines()]
    assert [m["img_size"] for m in metrics if "images_per_sec" in m] == [32, 48, 64]
    # the table, printed last, then the schedule row's phases (a blank line, its title, a blank line, a table)
    lines = r.stdout.strip().splitlines()
    assert lines[-len(rows) - 2 - (5 + len(phases)) - 4].startswith("| model | lever |")
    assert lines[-(5 + len(phases)) - 3].startswith("ViT-Ti/16 no-ckpt, one step profiled: attention aten::")
    assert lines[-(5 + len(phases)) - 1].startswith("ViT-Ti/16 plain, one step profiled: attention aten::")
    assert lines[-len(phases) - 2].startswith("| px | micro |")


def load_bench(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("vit_train_gpu", REPO / "benchmarks" / "vit_train_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_the_gpu_rows_resolve_as_the_gpu_would_and_differ_as_they_say(monkeypatch, tmp_path):
    """The rows a GPU run measures (not the smoke's), resolved here as each row's process would on an
    H200: every override is a key the schema knows, every row gets the plan's prediction, the blocks
    row differs from the eager no-ckpt row in train.compile alone, and the profiled steps lie in the
    last window (the first, with compile and warm-up, is never timed)."""
    from pretrain.config import load_config

    bench = load_bench(monkeypatch)
    rows, settings = bench.plan_rows(False)
    resolved = {}
    for row in rows:
        if row.lever == "plain":
            continue
        cfg = load_config(bench.ROOT / "configs" / f"{row.model}.yaml",
                          bench.row_overrides(row, tmp_path / "run", tmp_path / "ckpt", settings))
        got = bench.predicted(cfg, "NVIDIA H200", 141 * 2 ** 30)
        assert got["predicted_img_per_s"] > 0, (row, got)
        resolved[(row.model, row.lever)] = cfg, got
    (eager, e), (blocks, b) = resolved[("vit_l16_in21k", "no-ckpt")], resolved[("vit_l16_in21k", "blocks")]
    assert (eager.train.compile, blocks.train.compile) == (False, "blocks")
    assert b["reduce_bucket_size"] == e["reduce_bucket_size"] and b["checkpointed_blocks"] == e["checkpointed_blocks"]
    assert (eager.train.micro_batch_size, eager.zero.stage) == (blocks.train.micro_batch_size, blocks.zero.stage)
    profiled = {row.lever: row.profile_step for row in rows if row.profile_step}
    assert {"model", "micro128", "blocks"} <= set(profiled), profiled
    last_window = settings["steps"] - settings["log_every"]
    assert all(last_window < s <= settings["steps"] for s in profiled.values()), profiled


def test_predict_only_needs_no_output_folder(monkeypatch, tmp_path, capsys):
    """``--predict-only DEVICE`` as the benchmarks guide writes it: the table of predictions on
    stdout, no --output asked for and no folder made; the measuring run still needs --output."""
    bench = load_bench(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--predict-only", "NVIDIA H100 80GB HBM3"]) == 0
    out = capsys.readouterr().out
    assert "| ViT-L/16 | shipped |" in out and "| ViT-H/14 | model |" in out, out
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as e:
        bench.main(["--smoke"])
    assert e.value.code == 2 and "--output is required" in capsys.readouterr().err


DYNAMO = r"""
import sys, torch
torch._dynamo.config.recompile_limit = 2


@torch.compile(backend="eager")
def once(x):
    return torch.relu(x) + 1


@torch.compile(backend="eager")
def broken(x):
    y = x * 2
    print("a graph break")
    return y + 1


@torch.compile(backend="eager")
def reshaped(x):
    return x * 2


for _ in range(3):
    once(torch.randn(4))
print("=== the bad ones", file=sys.stderr, flush=True)
broken(torch.randn(3))
for rank in range(1, 5):  # a new tensor rank each call: a recompile, until the limit
    reshaped(torch.randn(*[2] * rank))
"""


def test_compile_events_are_read_from_torch_s_own_log(monkeypatch):
    """Each row's log is written under the benchmark's TORCH_LOGS; what it counts there, on the
    messages this torch writes: nothing for a function that compiles once, then a graph break and
    recompiles up to the recompile limit."""
    bench = load_bench(monkeypatch)
    r = subprocess.run([sys.executable, "-c", DYNAMO], env={**job_env(), "TORCH_LOGS": bench.COMPILE_LOGS},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    clean, bad = r.stderr.split("=== the bad ones")
    got = bench.compile_events(clean)
    assert got == {"recompiles": 0, "graph_breaks": 0, "recompile_limit_hit": False, "first": []}, got
    got = bench.compile_events(bad)
    assert got["graph_breaks"] >= 1 and got["recompiles"] >= 2 and got["recompile_limit_hit"], got
    assert got["first"][0].startswith("Graph break") and any(m.startswith("Recompiling") for m in got["first"])
