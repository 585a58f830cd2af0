"""`make demo` at reduced size, end to end: shards -> 2-rank DeepSpeed pre-training -> transfer ->
plots -> summary; a second invocation resumes instead of starting over."""
import json
import subprocess
import sys

import pytest
from dist_utils import job_env

pytestmark = pytest.mark.slow


def demo(out, steps):
    """From another folder than the checkout: the demo finds its own config."""
    return subprocess.run([sys.executable, "-m", "launch.demo", "--out", str(out), "--steps", str(steps),
                           "--samples", "768", "--transfer-samples", "240"],
                          cwd=out.parent, env=job_env(), capture_output=True, text=True, timeout=600)


def test_demo_end_to_end_and_resume(tmp_path):
    out = tmp_path / "demo"
    first = demo(out, 8)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    for name in ("train", "transfer-train", "transfer-test"):
        assert (out / "shards" / name / "manifest.json").is_file()
    assert "vitscale demo: done" in first.stdout

    second = demo(out, 16)  # more steps: continues from step 8's checkpoint, reuses the shards
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    text = second.stdout
    assert "already written" in text and "(resumed from step 8)" in text
    assert "pre-training   16 steps on 2 ranks" in text
    tr = json.loads((out / "transfer.json").read_text())
    task = tr["tasks"]["demo"]
    assert tr["step"] == 16 and task["chance"] == pytest.approx(1 / task["num_classes"])
    assert task["accuracy"] > 2 * task["chance"], task  # even 16 steps of features beat chance easily
    # what pre-training cost up to the evaluated checkpoint, as its run.json says it (both invocations')
    saved = json.loads((out / "run" / "checkpoints" / "step_00000016" / "run.json").read_text())
    assert tr["pretraining"] == {"device_hours": saved["device_seconds"] / 3600, "images_seen": saved["images_seen"],
                                 "model_flops": saved["model_flops"]} and saved["images_seen"] > 0, tr["pretraining"]
    for line in ("checkpoint     ", "metrics        ", "W&B (offline)  ", "wandb sync ", "plots          "):
        assert line in text
    assert "few-shot       10-shot on the held-out shapes while training:" in text
    # what pre-training cost, and the time to the demo's 10-shot target (not reached in 16 steps)
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert (f"  cost           {summary['device_seconds'] / 3600:.3g} device-hours of pre-training; "
            "eval/fewshot/demo/10shot >= 0.95 not reached in 16 steps\n") in text, text
    evals = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval/fewshot/demo/10shot" in r][-1] == 16
    png = out / "plots" / "training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag, value, least", [("--steps", "0", 1), ("--ranks", "0", 1), ("--samples", "0", 1),
                                                ("--transfer-samples", "1", 2)])
def test_counts_below_one_are_a_usage_line_before_anything_is_written(tmp_path, capsys, flag, value, least):
    """--samples 0 or --transfer-samples 0 meant "the whole split" (0 read as no --limit); --ranks 0
    ended in a LaunchError traceback after the shards were written."""
    from launch.demo import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "demo"), flag, value])
    assert (e.value.code, capsys.readouterr().err) == (2, f"vit-demo: error: {flag} {value}: must be >= {least}\n")
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("override, said", [
    ("optim.lrr=3e-3", "command line: unknown key 'optim.lrr'"), ("optim.lr=-1", "command line: optim.lr: "),
    # read with the demo's own probes and target: evaluation off leaves its target unmet, said first
    ("validation.every_steps=0", "command line: validation.target_metric: is read at an evaluation")])
def test_a_bad_override_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch, override, said):
    """Found by vit-train only after the shards were written and the runner started, on every rank."""
    from launch.demo import main

    monkeypatch.chdir(tmp_path)  # the config is the checkout's, wherever the demo starts
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "demo"), override])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"vit-demo: error: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "demo").exists()
