"""Training side: mistakes a new user makes, each one line and exit 2 (or a bounded
fallback), with real processes (`python -m pretrain.train`, `python -m pretrain.export`).

An unwritable folder is made with `chattr +i` as root (permission bits do not stop root), else
with mode 0555; the test is skipped where neither stops a write."""
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import REPO, TINY_MODEL, job_env, metrics, train_single

from pretrain.checkpointing import rundir


def train(shards, run_dir, *extra, env=None, timeout=180):
    return train_single(shards, run_dir, "zero.stage=0", "train.steps=2", "checkpoint.every_steps=2",
                        "train.log_every_steps=1", *extra, env=env, timeout=timeout)


def export(*args, timeout=120, umask=None):
    return subprocess.run([sys.executable, "-m", "pretrain.export", *map(str, args)], cwd=REPO, env=job_env(),
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def last_line(r) -> str:
    return r.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """One finished 2-step run (ZeRO-0), shared read-only by the tests below."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    r = train(shards, run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.fixture
def locked(tmp_path):
    """A folder (holding one file) that nothing can be written into."""
    d = tmp_path / "locked"
    d.mkdir()
    (d / "keep.txt").write_text("keep")
    root = os.geteuid() == 0 and shutil.which("chattr")
    if root:
        subprocess.run(["chattr", "+i", str(d)], check=True)
    else:
        d.chmod(0o555)
    try:
        try:
            (d / "probe").write_text("x")
        except OSError:
            pass
        else:
            pytest.skip("cannot make a folder unwritable here")
        yield d
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        else:
            d.chmod(0o755)


# ------------------------------------------------------------------------------ unwritable folder
@pytest.mark.parametrize("key", ["train.output_dir", "checkpoint.dir"])
def test_train_unwritable_folder_is_one_line_before_any_work(shards, tmp_path, locked, key):
    target = locked / "run"
    extra = [f"checkpoint.dir={target}"] if key == "checkpoint.dir" else []
    r = train(shards, target if key == "train.output_dir" else tmp_path / "run", *extra)
    assert r.returncode == 2, r.stderr[-3000:]
    assert last_line(r).startswith(f"vit-train: error: {key}={target}: cannot write in {locked}"), r.stderr
    assert "Traceback" not in r.stderr and "building" not in r.stderr  # checked before the model is built
    assert sorted(p.name for p in locked.iterdir()) == ["keep.txt"]


def test_export_unwritable_folder_is_one_line_before_consolidating(trained, locked):
    r = export(trained, locked / "x.safetensors")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vit-export: error: output folder={locked}: cannot write "
                                                   f"in {locked} ("), r.stderr
    assert sorted(p.name for p in locked.iterdir()) == ["keep.txt"]


def test_export_to_a_format_it_does_not_write_is_one_line(tmp_path):
    """`--format onnx` (not a format vit-export writes): argparse's usage block made it two lines."""
    r = export(tmp_path / "run", tmp_path / "m.onnx", "--format", "onnx")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "vit-export: error: argument --format: invalid choice: 'onnx' (choose from 'timm', 'hf')"], r.stderr


def test_export_failing_at_the_end_saves_the_weights_elsewhere(trained, tmp_path, monkeypatch, capsys):
    """The folder passed the check, then the final write failed (disk full, folder locked since):
    the weights go to the run directory and the one line says where."""
    from safetensors.torch import load_file

    from pretrain.weights import export as ex

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = ex.write_safetensors

    def failing(sd, out, meta):
        if out.parent == out_dir:
            raise OSError(28, "No space left on device")
        return real(sd, out, meta)

    monkeypatch.setattr(ex, "write_safetensors", failing)
    with pytest.raises(SystemExit) as exit_:
        ex.main([str(trained), str(out_dir / "x.safetensors")])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    saved = trained.absolute() / "x.safetensors"
    assert err == (f"vit-export: error: cannot write {out_dir / 'x.safetensors'} (No space left on device); "
                   f"the weights were saved to {saved} instead"), err
    assert len(load_file(saved)) > 0 and not list(out_dir.iterdir())
    saved.unlink()


# --------------------------------------------------------------------------------- export mode
def test_export_file_mode_follows_umask(trained, tmp_path):
    out = tmp_path / "w.safetensors"
    r = export(trained, out, umask=0o022)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temp file left


# ------------------------------------------------------------------------- resume, model changed
def test_resume_with_another_model_names_the_keys(shards, trained):
    before = rundir.latest_complete(trained / "checkpoints")
    config_before = (trained / "config.yaml").read_text()
    r = train(shards, trained, "model.name=vit_small_patch16_224", "optim.name=sgd", "train.steps=4")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "size mismatch" not in r.stderr
    line = last_line(r)
    assert line.startswith(f"vit-train: error: {before} was saved with other settings "
                           f"(model.name={TINY_MODEL}->vit_small_patch16_224, optim.name=adamw->sgd)"), line
    assert "another train.output_dir" in line
    # nothing lost: the checkpoint is still the newest, intact, and the run's config is untouched
    assert rundir.latest_complete(trained / "checkpoints") == before and rundir.verify(before) is None
    assert (trained / "config.yaml").read_text() == config_before


# ------------------------------------------------------------------------------ W&B online fails
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


@pytest.mark.parametrize("case", ["no_key", "unreachable"])
def test_wandb_online_falls_back_to_offline(shards, tmp_path, case):
    home = tmp_path / "home"  # no ~/.netrc, no settings file with a key
    # the real cache folder stays: torch keeps DeepSpeed's JIT-built CPU op there (~/.cache/torch_extensions),
    # and an empty one would rebuild it (40 s)
    env = job_env(HOME=home, WANDB_CONFIG_DIR=home / ".config" / "wandb", WANDB_CACHE_DIR=home / "cache",
                  XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_ENTITY"):
        env.pop(k, None)
    if case == "unreachable":
        env.update(WANDB_API_KEY="x" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{closed_port()}")
    run_dir = tmp_path / "run"
    t0 = time.time()
    r = train(shards, run_dir, "logging.wandb.mode=online", "logging.wandb.init_timeout_s=4", env=env, timeout=120)
    took = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if "W&B online could not start" in ln]
    assert len(lines) == 1, r.stderr[-3000:]
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and f"wandb sync {offline[0]}" in lines[0], (lines, offline)
    assert list(offline[0].glob("*.wandb")), "the offline run holds no data file"
    assert sorted(metrics(run_dir)) == [1, 2] and "Traceback" not in r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["wandb_dir"] == str(offline[0])
    assert took < 90, f"took {took:.0f} s"  # the wait is bounded by init_timeout_s (4 s here)


# ------------------------------------------------------------------- a save that fails mid-run
def test_checkpoint_folder_locked_mid_run_names_the_last_good_checkpoint(tiny_run, tmp_path):
    """The folder passed the start-up check, then became unwritable: the failed save is one line
    (exit 2) naming the last complete checkpoint, which stays intact for the resume."""
    from dist_utils import wait_for

    if os.geteuid() != 0 or not shutil.which("chattr"):
        pytest.skip("needs root and chattr to lock a folder under a running job")
    job = tiny_run("zero.stage=0", "train.steps=60", "checkpoint.every_steps=30")
    log = tmp_path / "log.txt"
    ckpts = job.run_dir / "checkpoints"
    proc = job.start(log)
    first = ckpts / rundir.tag_for(30)
    try:
        wait_for(lambda: (first / rundir.COMPLETE).is_file(), 120, proc, "the first checkpoint")
        subprocess.run(["chattr", "+i", str(ckpts)], check=True)
        code = proc.wait(120)
    finally:
        subprocess.run(["chattr", "-i", str(ckpts)], check=False)
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert code == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"vit-train: error: cannot save checkpoint step_00000060 in {ckpts} (Operation not "
                           "permitted): "), out[-3000:]
    assert f"the last complete checkpoint is {first} (verified); " in last and " MB free, a checkpoint needs" in last
    assert "Traceback" not in out and rundir.verify(first) is None and rundir.latest_complete(ckpts) == first
