"""logging.profile: which steps a config records, what a trace's summary says (the device's busy
share from its kernels and copies, not the annotation spans that cover a whole step), who records,
and one line for a config that records nothing. A real run's traces: ZeRO-3 on two ranks in
tests/integration/test_distributed.py."""
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.observability.config import ProfileConfig
from pretrain.observability.profile import StepProfiler, busy_share, profiled_steps, summarize


def test_busy_share_counts_overlapping_work_once_and_only_inside_the_span():
    assert busy_share([], 0, 10) == 0.0
    assert busy_share([(0, 10)], 0, 10) == 1.0
    assert busy_share([(1, 4), (2, 6), (8, 9)], 0, 10) == pytest.approx(0.6)  # 1-6 and 8-9
    assert busy_share([(3, 5), (1, 2), (4, 7)], 0, 10) == pytest.approx(0.5)  # unsorted: 1-2, 3-7
    assert busy_share([(-5, 2), (9, 20)], 0, 10) == pytest.approx(0.3)  # clipped to the span
    assert busy_share([(0, 10), (2, 3)], 0, 10) == 1.0  # nested
    assert busy_share([(1, 2)], 5, 5) == 0.0


@dataclass
class Avg:  # the fields of torch's FunctionEventAvg that summarize reads
    key: str
    count: int
    self_device_time_total: float = 0.0
    self_cpu_time_total: float = 0.0


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_gpu_trace_s_busy_share_is_its_kernels_and_copies_over_the_marked_steps():
    """Two steps marked on the host (0-400 and 400-700 us); the device works 50-250 (two streams
    overlapping), copies 300-350, works 600-900: past the host's last mark, as a device does that
    runs behind its queue. The device-side annotation spans and the runtime's sync cover the whole
    span and are not work."""
    trace = {"traceEvents": [
        event("user_annotation", "vit-train step 7", 0, 400),
        event("user_annotation", "vit-train step 8", 400, 300),
        event("user_annotation", "gloo:all_gather", 10, 5),
        event("gpu_user_annotation", "vit-train step 7", 0, 900),
        event("gpu_user_annotation", "CompiledFxGraph", 0, 900),
        event("cuda_runtime", "cudaDeviceSynchronize", 700, 200),
        event("kernel", "sm90_gemm", 50, 150),
        event("kernel", "triton_poi_fused", 100, 150),
        event("gpu_memcpy", "Memcpy HtoD", 300, 50),
        event("kernel", "flash_fwd", 600, 300),
        event("cpu_op", "aten::mm", 0, 700),
        {"ph": "i", "cat": "kernel", "name": "an instant, not a span", "ts": 0},
    ]}
    averages = [Avg("aten::mm", 4, self_device_time_total=300.0), Avg("vit-train step 7", 1, 900.0),
                Avg("aten::_scaled_dot_product_flash_attention", 2, 300.0), Avg("aten::add_", 8, 0.0)]
    s = summarize(trace, averages, "cuda")
    assert s["steps"] == 2 and s["time"] == "device"
    assert s["ms_per_step"] == pytest.approx(0.45)  # 0-900 us over two steps
    assert s["busy_share"] == pytest.approx((200 + 50 + 300) / 900)
    assert s["attention"] == ["aten::_scaled_dot_product_flash_attention"]
    assert [t["name"] for t in s["top"]] == ["aten::mm", "aten::_scaled_dot_product_flash_attention"]
    assert s["top"][0]["ms_per_step"] == pytest.approx(0.15)


def test_a_cpu_trace_s_busy_share_is_its_torch_ops():
    trace = {"traceEvents": [event("user_annotation", "vit-train step 3", 0, 100),
                             event("cpu_op", "aten::mm", 10, 40), event("cpu_op", "aten::addmm", 20, 10),
                             event("cpu_op", "aten::add", 70, 10), event("kernel", "none here", 0, 100)]}
    s = summarize(trace, [Avg("aten::mm", 1, self_cpu_time_total=40.0)], "cpu")
    assert s["time"] == "cpu" and s["busy_share"] == pytest.approx(0.5) and s["ms_per_step"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no step marks"):
        summarize({"traceEvents": [event("cpu_op", "aten::mm", 0, 1)]}, [], "cpu")


def test_the_window_holding_profiled_steps_counts_them():
    cfg = ProfileConfig(start_step=7, steps=2)
    assert [profiled_steps(cfg, a, b) for a, b in [(1, 5), (6, 10), (8, 12), (1, 7), (9, 20)]] == [0, 2, 1, 1, 0]
    assert profiled_steps(ProfileConfig(), 1, 100) == 0


def test_who_records_and_a_config_that_records_nothing_says_so(tmp_path):
    said = []
    of = lambda cfg, **kw: StepProfiler.of(cfg, **{**dict(rank=0, world=2, start_step=0, steps=20,  # noqa: E731
                                                           root=tmp_path, device="cpu", say=said.append), **kw})
    assert of(ProfileConfig()) is None and said == []
    assert of(ProfileConfig(start_step=5)).records and not of(ProfileConfig(start_step=5), rank=1).records
    assert of(ProfileConfig(start_step=5, ranks=[]), rank=1).records
    assert of(ProfileConfig(start_step=5, ranks=[1]), rank=0).window_steps(1, 10) == 1  # rank 0 logs the window
    assert of(ProfileConfig(start_step=5, ranks=[2, 3])) is None
    assert said[-1] == "logging.profile.ranks=[2, 3]: no such rank in a world of 2: nothing is profiled"
    assert of(ProfileConfig(start_step=25)) is None
    assert "start_step=25: outside the steps this run takes (1-20)" in said[-1]
    assert of(ProfileConfig(start_step=5, steps=3), start_step=7) is None  # resumed past them
    assert "(8-20)" in said[-1]
    assert of(ProfileConfig(start_step=5, steps=3), start_step=6).records  # step 7 is still ahead
    p = of(ProfileConfig(start_step=5, ranks=[1]))
    assert p.before(5) == 0.0 and p.after(5) == 0.0  # not this rank's: nothing recorded, nothing written
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("override, key", [("logging.profile.start_step=-1", "logging.profile.start_step"),
                                           ("logging.profile.steps=0", "logging.profile.steps"),
                                           ("logging.profile.ranks=[0,-1]", "logging.profile.ranks")])
def test_bad_profile_values_are_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml", [override])
    assert key in str(e.value) and "\n" not in str(e.value)


def recorded(p: StepProfiler, steps, stop_at=None) -> None:
    """Steps of a matmul under ``p`` as the loop runs them (before, the step, after; close at the end)."""
    x = torch.randn(16, 16)
    for step in steps:
        p.before(step)
        x = torch.tanh(x @ x)
        p.after(step)
        if step == stop_at:
            break
    p.close(step)


def marks(folder) -> list[str]:
    with gzip.open(folder / "rank-0.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e["name"] for e in events if e.get("cat") == "user_annotation"), key=lambda n: int(n.split()[-1]))


@pytest.mark.parametrize("start, stop_at, configured, run_steps, folder, want", [
    (0, None, (5, 3), 20, "steps-5-7", [5, 6, 7]),  # as configured
    (5, None, (5, 4), 20, "steps-6-8", [6, 7, 8]),  # resumed after step 5: the rest of them
    (0, 6, (5, 4), 20, "steps-5-6", [5, 6]),  # stopped after step 6: what it recorded
    (0, None, (18, 5), 20, "steps-18-20", [18, 19, 20]),  # the run ends at step 20
])
def test_the_steps_a_run_takes_are_recorded_and_written(tmp_path, capsys, start, stop_at, configured, run_steps,
                                                        folder, want):
    """torch's profiler around a real (CPU) step: the trace holds exactly the steps this run takes of
    the configured ones, each marked, in ``profile/steps-FIRST-LAST``, and one line says so."""
    cfg = ProfileConfig(start_step=configured[0], steps=configured[1])
    p = StepProfiler.of(cfg, rank=0, world=1, start_step=start, steps=run_steps, root=tmp_path, device="cpu",
                        say=print)
    recorded(p, range(start + 1, run_steps + 1), stop_at)
    assert [d.name for d in (tmp_path / "profile").iterdir()] == [folder]
    assert marks(tmp_path / "profile" / folder) == [f"vit-train step {n}" for n in want]
    summary = json.loads((tmp_path / "profile" / folder / "rank-0.json").read_text())
    assert summary["steps"] == len(want) and summary["top"] and 0 < summary["busy_share"] <= 1, summary
    err = capsys.readouterr().err
    assert f"vit-train: rank 0 profiled steps {want[0]}-{want[-1]}: " in err and "in torch ops" in err


def test_a_trace_that_cannot_be_written_is_one_line_and_the_run_goes_on(tmp_path, capsys):
    """A file where the profile folder belongs (a real OSError from the write): one line naming the
    steps and the error, nothing raised, and the steps after it run unrecorded."""
    (tmp_path / "profile").write_text("not a folder")
    p = StepProfiler.of(ProfileConfig(start_step=2, steps=2), rank=0, world=1, start_step=0, steps=5,
                        root=tmp_path, device="cpu", say=print)
    recorded(p, range(1, 6))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vit-train: rank 0: logging.profile steps 2-3: NotADirectoryError: ")
    assert err[0].endswith("; training goes on without it") and str(tmp_path / "profile") in err[0]
    assert p.prof is None and not p.records and p.metrics() == {}
    assert (tmp_path / "profile").read_text() == "not a folder"
