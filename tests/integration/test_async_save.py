"""Asynchronous checkpoints (checkpoint.async): the same files as a synchronous save, the training
thread never holds a whole write, and a kill -9 in the middle of a background write resumes
from the previous checkpoint, exactly."""
import json
import threading
import time
import zipfile

import pytest
import torch
from dist_utils import metrics

from pretrain.checkpointing import checkpoint
from pretrain.checkpointing.async_save import SnapshotEngine, snapshot
from pretrain.weights.export import load_run_weights

COMMON = ["zero.stage=2", "train.steps=6", "train.log_every_steps=1", "checkpoint.every_steps=2",
          "checkpoint.keep_last=5", "optim.warmup_steps=2", "train.ema_decay=0.9"]


def zip_members(path) -> dict:
    """A torch.save file's members, less the random id torch writes into every file."""
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def test_snapshot_is_private_and_keeps_storage_sharing(tmp_path):
    flat = torch.arange(12, dtype=torch.float32)
    live = {"a": flat[:6].view(2, 3), "b": flat[6:], "n": 3, "nested": [flat[:2], ("x", flat)]}
    snap = snapshot(live)
    flat.add_(100)  # the optimizer steps on after the snapshot
    assert snap["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and snap["nested"][1][1][11] == 11
    # views of one storage stay views of one (copied) storage: torch.save writes it once
    assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()
    assert snap["a"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    (tmp_path / "snap").mkdir(), (tmp_path / "live").mkdir()  # torch.save names its zip root after the file
    state = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict carrying _metadata
    state["flat"] = flat
    torch.save(snapshot(state), tmp_path / "snap" / "x.pt")
    torch.save(state, tmp_path / "live" / "x.pt")
    assert zip_members(tmp_path / "snap" / "x.pt") == zip_members(tmp_path / "live" / "x.pt")


def test_writer_runs_off_the_calling_thread_and_reports_errors(tmp_path):
    gate = threading.Event()
    eng = SnapshotEngine()
    eng.submit(gate.wait)  # the writer is busy: save() must not wait for it
    t0 = time.perf_counter()
    eng.save({"w": torch.ones(1000)}, str(tmp_path / "w.pt"))
    assert time.perf_counter() - t0 < 5 and not eng.idle() and not (tmp_path / "w.pt").exists()
    gate.set()
    eng.wait()
    assert torch.load(tmp_path / "w.pt")["w"].sum() == 1000
    eng.save({"w": torch.ones(3)}, str(tmp_path / "missing" / "w.pt"))
    with pytest.raises(RuntimeError, match="does not exist"):  # torch.save's own error, raised here
        eng.wait()
    assert eng.error is not None


def test_a_failed_background_write_is_said_for_its_own_checkpoint(tmp_path):
    """A background write that fails (torch.save's own error) is learnt at a later sync point: the
    line names the checkpoint that write belonged to and what it failed on, and that checkpoint's
    partial folder is removed; the step of the sync point named nothing that was ever written."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from pretrain.checkpointing.async_save import Saver
    from pretrain.checkpointing.checkpointer import Checkpointer, CheckpointWriteError
    from pretrain.config import load_config

    cfg = load_config("configs/tiny_cpu.yaml", ["checkpoint.async=true", "checkpoint.every_steps=1000",
                                                "train.steps=5000"])
    ckpts = tmp_path / "checkpoints"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        checkpointer = Checkpointer(cfg, SimpleNamespace(), None, ckpts, {}, None, None)
        saver = checkpointer.saver
        assert isinstance(saver, Saver)
        partial = ckpts / "step_00001000"
        partial.mkdir(parents=True)
        saver.writer.save({"w": torch.ones(3)}, str(partial / "gone" / "w.pt"))  # its folder is missing
        saver.start(1000, partial)
        with pytest.raises(CheckpointWriteError) as e:
            for _ in range(500):  # the sync points after the save, until its write has ended
                checkpointer.maybe_save(1010, sync=True)
                time.sleep(0.01)
        line = str(e.value)
        assert line.startswith(f"cannot save checkpoint step_00001000 in {ckpts} (") and "does not exist" in line, line
        assert "another rank" not in line and not partial.exists()
    finally:
        dist.destroy_process_group()


def safetensors_content(path) -> tuple[dict, dict]:
    """(metadata, {name: values as bytes}): a file's content, whatever order its header lists them in."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}


def test_async_run_matches_sync_and_survives_kill9_mid_write(tiny_run):
    sync_job, async_job = tiny_run(*COMMON, name="sync"), tiny_run(*COMMON, "checkpoint.async=true", name="async")
    sync, run = sync_job.run_dir, async_job.run_dir
    r = sync_job.run()
    assert r.returncode == 0, r.stderr[-3000:]
    # the writer thread SIGKILLs the process in the middle of writing step 4's files
    r = async_job.run(VITSCALE_FAULT="kill_in_save:4")
    assert r.returncode == -9, r.stderr[-3000:]
    ckpts = run / "checkpoints"
    assert (ckpts / "step_00000004").is_dir() and not (ckpts / "step_00000004" / "COMPLETE").exists()
    assert checkpoint.latest_complete(ckpts).name == "step_00000002"
    r = async_job.run()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 2" in r.stderr
    # the same files as the synchronous saves (run.json holds the output folder)
    for step in (2, 6):
        tag = checkpoint.tag_for(step)
        names = sorted(p.name for p in (sync / "checkpoints" / tag).iterdir())
        assert names == sorted(p.name for p in (ckpts / tag).iterdir())
        for n in names:
            if n.endswith(".pt"):
                assert zip_members(sync / "checkpoints" / tag / n) == zip_members(ckpts / tag / n), (tag, n)
            elif n.startswith("rank_"):  # loader position, torch RNG (Python and NumPy are never seeded)
                a, b = (json.loads((d / tag / n).read_text()) for d in (sync / "checkpoints", ckpts))
                [r["rng"].pop(k) for r in (a, b) for k in ("python", "numpy")]
                assert a == b, (tag, n)
            elif n.startswith("ema_rank_"):  # the weights' EMA, snapshotted and written by the writer thread
                assert safetensors_content(sync / "checkpoints" / tag / n) == safetensors_content(ckpts / tag / n)
    a, _ = load_run_weights(sync)
    b, info = load_run_weights(run)
    assert info["step"] == 6 and all(torch.equal(a[k], b[k]) for k in a)
    assert any(n.startswith("ema_rank_") for n in names)
    a, _ = load_run_weights(sync, ema=True)
    b, _ = load_run_weights(run, ema=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = metrics(sync), metrics(run)
    assert [ma[s]["loss"] for s in range(1, 7)] == [mb[s]["loss"] for s in range(1, 7)]
