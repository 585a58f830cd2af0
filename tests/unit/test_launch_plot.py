"""`python -m launch.plot_scaling`: reads the files a training run writes (metrics.jsonl through the
project's own MetricsLogger, summary.json), drops the warm-up window, and draws the PNG."""
import json
import subprocess
import sys

import pytest

from launch.plot_scaling import PlotError, load_run, scaling_table
from pretrain.observability.config import LoggingConfig, WandbConfig
from pretrain.observability.metrics import MetricsLogger, throughput

# images/s of the whole job after warm-up: 95% then 90% of linear
RATES = {1: 100.0, 2: 190.0, 4: 360.0}


def write_run(run_dir, world, rate, windows=4, summary=True, warmup_rate=10.0, peak_tflops=None):
    """A run's metrics as train.py writes them: one record per window from metrics.throughput,
    written by MetricsLogger; the first window is slow (warm-up)."""
    logger = MetricsLogger(LoggingConfig(wandb=WandbConfig(mode="disabled")), run_dir, rank=0, run_config={})
    for w in range(windows):
        ips = warmup_rate if w == 0 else rate
        # 10 steps of 8 images per rank; elapsed chosen to give `ips`
        images = 10 * 8 * world
        logger.log((w + 1) * 10, {"loss": 2.3 - 0.1 * w, "data_wait_share": 0.02,
                                  **throughput(images, images / ips, world, 1.0e9, 1.0e9, peak_tflops)})
    logger.close()
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({"step": windows * 10, "world_size": world}))
    return run_dir


@pytest.fixture()
def runs(tmp_path):
    return [write_run(tmp_path / f"ws{n}", n, r) for n, r in RATES.items()]


def test_table_drops_warmup_and_computes_efficiency(runs):
    rows = scaling_table([load_run(d) for d in runs])
    assert [r["world_size"] for r in rows] == [1, 2, 4]
    assert [round(r["images_per_sec"], 6) for r in rows] == [100.0, 190.0, 360.0]  # warm-up (10/s) dropped
    assert [round(r["efficiency"], 6) for r in rows] == [1.0, 0.95, 0.9]
    assert rows[1]["images_per_sec_per_rank"] == pytest.approx(95.0)


def test_throughput_is_the_windows_images_over_their_seconds(tmp_path):
    """Two windows of equal images at 100 and 300 images/s took 4/300 of the time per image: 150
    images/s, not the 200 a mean of the rates says; MFU and data wait are weighted by the seconds."""
    logger = MetricsLogger(LoggingConfig(wandb=WandbConfig(mode="disabled")), tmp_path, rank=0, run_config={})
    for w, (ips, wait) in enumerate([(10.0, 0.9), (100.0, 0.3), (300.0, 0.1)]):
        images = 80 * 2
        logger.log((w + 1) * 10, {"examples_seen": images * (w + 1), "data_wait_share": wait,
                                  **throughput(images, images / ips, 2, 1.0e9, 1.0e9, 1.0)})
    logger.close()
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 2}))
    s = load_run(tmp_path)
    assert s.images_per_sec == pytest.approx(150.0) and s.windows == 2
    assert s.data_wait_share == pytest.approx((0.3 * 3 + 0.1 * 1) / 4)  # the slow window is 3/4 of the time
    assert s.mfu == pytest.approx(150.0 / 2 * 1.0e9 / 1.0e12)  # the run's FLOPs over its seconds, per device


def test_cli_writes_png_and_prints_table(runs, tmp_path):
    out = tmp_path / "plots" / "scaling.png"
    r = subprocess.run([sys.executable, "-m", "launch.plot_scaling", *map(str, runs), "--output", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["world", "runs", "images/s", "per", "rank", "efficiency", "data", "wait", "MFU"]
    assert lines[3].split()[:5] == ["4", "1", "360.0", "90.0", "90.0%"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w, _ = matplotlib.image.imread(out).shape
    assert (w, h) == (1100, 418)  # 10 x 3.8 inches at 110 dpi: the two panels were drawn


def test_world_size_without_summary_and_repeated_runs(tmp_path):
    """A run killed before summary.json still counts (world size from its per-device rate);
    two runs of one size are pooled."""
    a = write_run(tmp_path / "a", 2, 180.0, summary=False)
    b = write_run(tmp_path / "b", 2, 200.0)
    assert load_run(a).world_size == 2
    (row,) = scaling_table([load_run(a), load_run(b)])
    assert row["runs"] == 2 and row["images_per_sec"] == pytest.approx(2 / (1 / 180 + 1 / 200))  # equal images


def test_runs_of_one_size_are_pooled_not_averaged(tmp_path):
    """One window at 100 images/s and four at 300 (equal images each): 5 windows' images over their
    1.6 + 4 x 0.53 s, 214 images/s, not the 200 the mean of the two runs' rates says; MFU and data
    wait weighted by each run's seconds."""
    runs = [load_run(write_run(tmp_path / name, 2, rate, windows=n, peak_tflops=1.0))
            for name, rate, n in (("a", 100.0, 2), ("b", 300.0, 5))]
    (row,) = scaling_table(runs)
    assert row["images_per_sec"] == pytest.approx(5 * 160 / (160 / 100 + 4 * 160 / 300))
    a, b = runs
    assert row["mfu"] == pytest.approx((a.mfu * a.seconds + b.mfu * b.seconds) / (a.seconds + b.seconds))
    assert row["mfu"] == pytest.approx(row["images_per_sec"] / 2 * 1.0e9 / 1.0e12)  # the pooled rate's
    assert row["data_wait_share"] == pytest.approx(0.02)


def test_resumed_run_keeps_last_record_per_step(tmp_path):
    d = write_run(tmp_path / "r", 1, 100.0)
    with open(d / "metrics.jsonl", "a") as f:  # a resume re-logs step 40 (then was killed mid-line)
        f.write(json.dumps({"step": 40, "images_per_sec": 130.0, "images_per_sec_per_device": 130.0}) + "\n")
        f.write('{"step": 50, "images_per')
    s = load_run(d)
    assert s.windows == 3 and s.images_per_sec == pytest.approx(3 / (2 / 100 + 1 / 130))  # equal windows' images


def test_every_window_marked_cold_is_dropped_a_resumes_first_too(tmp_path):
    """vit-train marks the windows that hold a first step (``cold_steps``): each invocation's first,
    a resume's included, and a resolution phase's. All of them are warm-up, not only the file's
    first record."""
    logger = MetricsLogger(LoggingConfig(wandb=WandbConfig(mode="disabled")), tmp_path, rank=0, run_config={})
    images, seen = 80, 0
    # (step, images/s, cold): a start, a kill after step 30, a resume from step 20 whose first window
    # (the loader's replay, a trace) is slow, then steady windows
    for step, ips, cold in [(10, 10.0, 1), (20, 100.0, 0), (30, 100.0, 0), (30, 5.0, 1), (40, 200.0, 0)]:
        seen = step * 8
        logger.log(step, {"examples_seen": seen, "cold_steps": cold, **throughput(images, images / ips, 1, 1.0e9,
                                                                                  1.0e9, None)})
    logger.close()
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 1}))
    s = load_run(tmp_path)
    # step 30 keeps its last record (the resume's cold one): windows 20 and 40 remain
    assert s.windows == 2 and s.images_per_sec == pytest.approx(2 / (1 / 100 + 1 / 200))


def test_unusable_run_dirs_are_one_line_errors(tmp_path):
    write_run(tmp_path / "short", 1, 100.0, windows=1)
    with pytest.raises(PlotError, match="1 logged window"):
        load_run(tmp_path / "short")
    r = subprocess.run([sys.executable, "-m", "launch.plot_scaling", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"plot_scaling: error: {tmp_path / 'nothing'}: no metrics.jsonl "
        "(is it a train.output_dir with logging.jsonl=true?)"]
