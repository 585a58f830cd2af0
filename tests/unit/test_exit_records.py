"""What a scheduler reads when a job ends: vit-launch's exit code and closing line for every outcome,
and status.json's states."""
import json
import signal

import pytest

from launch.supervise import outcome
from pretrain.resilience.lifecycle import RunStatus, goodbye_line, resume_command, spent_before, write_status


@pytest.mark.parametrize("raw, code, says", [
    (0, 0, "completed"), (2, 2, "user error"), (3, 3, "hang watchdog"), (75, 75, "run the same command"),
    (130, 130, "killed without a checkpoint"), (1, 1, "exit code 1"),
    (69, 69, "shard store stayed unreachable past data.remote_retry_s"),  # restarted and requeued, not a mistake
    (256 - signal.SIGKILL, 1, "killed by SIGKILL (raw exit code 247)"),  # DeepSpeed's launcher, a rank killed
    (256 - signal.SIGSEGV, 1, "killed by SIGSEGV"),
    (128 + signal.SIGTERM, 1, "killed by SIGTERM"),
    (7, 1, "exit code 7"),
])
def test_every_way_a_job_ends_maps_to_a_documented_code_and_one_line(raw, code, says):
    got, line = outcome(raw)
    assert got == code and says in line and "\n" not in line, (got, line)
    assert got in (0, 1, 2, 3, 69, 75, 130)  # the table in pretrain/resilience/lifecycle.py


@pytest.mark.parametrize("raw", [75, 69, 130])
def test_the_closing_line_names_what_resumes_the_job_or_nothing(raw):
    """Started with checkpoint.resume=false, the same command starts over: the line names the
    override; a sweep's sizes always start over: it promises no resume at all."""
    code, line = outcome(raw, resume_command(False))
    assert code == raw and "the same command with checkpoint.resume=true" in line and "resume" in line, line
    code, line = outcome(raw, None)
    assert code == raw and "resume" not in line and line == outcome(raw)[1].split(";")[0], line


def test_status_says_running_then_the_processs_own_exit_code(tmp_path):
    path = tmp_path / "status.json"
    RunStatus(path)(7)
    doc = json.loads(path.read_text())
    assert doc["state"] == "running" and doc["step"] == 7 and "exit_code" not in doc
    write_status(path, "failed", 9, 2)
    assert json.loads(path.read_text())["exit_code"] == 2
    write_status(path, "interrupted", 10)
    assert json.loads(path.read_text())["exit_code"] == 75
    RunStatus(None)(3)  # other ranks write nothing
    assert json.loads(path.read_text())["step"] == 10


def test_the_spent_device_seconds_carry_over_and_the_last_line_says_the_cost(tmp_path):
    """status.json's device_seconds_spent is what the next invocation starts from (0 without one, or
    from a file of a release without it); vit-train's last line gives the device-hours that led to
    the checkpoint, and the work no checkpoint kept where it is more than 5 % of that."""
    path = tmp_path / "status.json"
    assert spent_before(path) == 0.0
    RunStatus(path, spent=lambda: 7200.0004)(5)
    assert json.loads(path.read_text())["device_seconds_spent"] == 7200.0 and spent_before(path) == 7200.0
    write_status(path, "failed", 6, 1)  # a status without the figure
    assert spent_before(path) == 0.0
    done = {"step": 12, "run_dir": "r", "preempted": False, "device_seconds": 7200.0}
    for spent, said in ((None, ""), (7500.0, ""), (9000.0, " (+0.5 spent past the checkpoints)")):
        line = goodbye_line({**done, "device_seconds_spent": spent}, "r/checkpoints/step_00000012")
        assert line.startswith(f"vit-train: done at step 12 after 2 device-hours{said}: checkpoint r/"), line
    assert goodbye_line({**done, "device_seconds": None}, "c").startswith("vit-train: done at step 12: checkpoint c;")
    # a target (validation.target_metric): where it was reached, or that it was not
    reached = {"step": 8, "device_hours": 1.5}
    assert goodbye_line({**done, "target": "eval/top1 >= 0.75", "target_reached": reached}, "c").startswith(
        "vit-train: done at step 12 after 2 device-hours; eval/top1 >= 0.75 reached at step 8 after 1.5 device-hours: ")
    assert goodbye_line({**done, "target": "eval/loss <= 2"}, "c").startswith(
        "vit-train: done at step 12 after 2 device-hours; eval/loss <= 2 not reached: checkpoint c;")


def test_a_stop_request_file_asks_with_its_first_line_or_its_name_when_empty(tmp_path):
    """vit-launch writes a reason; a person may only ``touch`` the file: both stop the job."""
    import signal

    from pretrain.resilience.lifecycle import StopRequest

    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        for text, want in (("", "stop.request"), ("slow node worker-2: 1.7x\nmore\n", "slow node worker-2: 1.7x")):
            stop = StopRequest(watch_launcher=False)
            path = tmp_path / "stop.request"
            path.write_text(text)
            stop.watch_file(path)
            stop._look()
            assert stop.reason == want, (text, stop.reason)
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])


def test_a_checkpoint_of_an_older_release_leaves_the_runs_device_time_unknown():
    """Its run.json holds no device-seconds: counting from the resume on would read as the whole
    run's cost, on the card, in the metrics and in the last line; the figure is unknown instead."""
    import time

    from pretrain.observability.window import RunTotals

    t = RunTotals()
    t.carry({"step": 4, "config": {"train": {"global_batch_size": 16}}})
    t.begin(time.time() - 10, 2)
    assert (t.record()["device_seconds"], t.record()["model_flops"], t.record()["images_seen"]) == (None, None, 64)
    assert 20 <= t.spent() < 30  # what this invocation spends is still counted in status.json
    t.carry({"step": 4, "device_seconds": 30.0, "images_seen": 64, "model_flops": 1e12})
    assert 50 <= t.record()["device_seconds"] < 60
