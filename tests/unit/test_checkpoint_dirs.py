"""Which checkpoint of a folder counts (``pretrain/checkpointing/rundir.py``): our tags by their
``COMPLETE`` marker alone, a foreign DeepSpeed run's by ``latest``; a resume's pick keeps
``latest`` on what it picked; a fresh start keeps an earlier run's checkpoints out of its pruning."""
from pathlib import Path

from pretrain.checkpointing import rundir
from pretrain.checkpointing.checkpoint import _prune


def saved(root: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint folder as a save leaves it: its files, then (complete) the marker listing them."""
    ckpt = root / rundir.tag_for(step)
    ckpt.mkdir(parents=True)
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * (step + 1))
    (ckpt / "run.json").write_text(f'{{"step": {step}}}')
    if complete:
        (ckpt / rundir.COMPLETE).write_text(rundir.marker(step, ckpt))
    return ckpt


def test_latest_names_a_complete_checkpoint_only_in_a_foreign_deepspeed_run(tmp_path):
    saved(tmp_path, 2)
    saved(tmp_path, 4, complete=False)  # being saved again (or half-written by a kill) while latest names it
    (tmp_path / rundir.LATEST).write_text("step_00000004")
    assert [p.name for p in rundir.list_complete(tmp_path)] == ["step_00000002"]

    foreign = tmp_path / "ds"
    for step in (10, 20):
        (foreign / f"global_step{step}").mkdir(parents=True)
    (foreign / rundir.LATEST).write_text("global_step20")  # DeepSpeed writes latest after the files
    assert [p.name for p in rundir.list_complete(foreign)] == ["global_step20"]


def test_a_pick_past_a_damaged_checkpoint_points_latest_at_the_one_picked(tmp_path):
    for step in (2, 4, 6):
        saved(tmp_path, step)
    (tmp_path / rundir.LATEST).write_text("step_00000006")
    newest = tmp_path / "step_00000006" / "mp_rank_00_model_states.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated after its marker was written
    said = []
    assert rundir.pick(tmp_path, said.append) == tmp_path / "step_00000004"
    assert (tmp_path / rundir.LATEST).read_text() == "step_00000004"
    assert (tmp_path / rundir.DAMAGED / "step_00000006").is_dir()
    assert len(said) == 2 and "step_00000006 is damaged" in said[0] and "moved step_00000006" in said[1], said

    # the same step saved again and cut short by a kill: its folder has no marker, the resume after
    # it picks step 4 again, not the half-written folder
    saved(tmp_path, 6, complete=False)
    assert rundir.pick(tmp_path, said.append) == tmp_path / "step_00000004"

    for p in tmp_path.glob("step_*/*.pt"):
        p.unlink()
    assert rundir.pick(tmp_path, said.append) is None
    assert not (tmp_path / rundir.LATEST).exists()  # names nothing rather than a moved folder


def test_bytes_changed_in_place_fail_the_checksum(tmp_path):
    """Damage that keeps a file's size (a flipped bit, a page overwritten) is seen by the checksum
    alone: any byte of the file, the last one too, and every file the marker lists."""
    ckpt = saved(tmp_path, 2)
    assert rundir.verify(ckpt) is None
    for name in ("mp_rank_00_model_states.pt", "run.json"):
        f = ckpt / name
        good = f.read_bytes()
        for at in (0, len(good) // 2, len(good) - 1):
            bad = bytearray(good)
            bad[at] ^= 0x01
            f.write_bytes(bytes(bad))
            assert rundir.verify(ckpt) == f"{f}: checksum differs from the one recorded at save time", (name, at)
        f.write_bytes(good)
        assert rundir.verify(ckpt) is None

def test_a_fresh_start_keeps_an_earlier_runs_checkpoints_out_of_its_pruning(tmp_path):
    for step in (3000, 4000, 5000):
        saved(tmp_path, step)
    saved(tmp_path, 6000, complete=False)  # the earlier run's last, cut short
    (tmp_path / rundir.LATEST).write_text("step_00005000")
    assert rundir.set_aside_earlier(tmp_path) == tmp_path / "earlier-1"

    saved(tmp_path, 1000)  # the fresh run's first save, then its pruning to keep_last=3
    _prune(tmp_path, keep_last=3)
    assert rundir.latest_complete(tmp_path) == tmp_path / "step_00001000"
    kept = tmp_path / "earlier-1"
    assert [p.name for p in rundir.list_complete(kept)] == ["step_00003000", "step_00004000", "step_00005000"]
    assert (kept / "step_00006000").is_dir() and (kept / rundir.LATEST).read_text() == "step_00005000"
    assert all(rundir.verify(p) is None for p in rundir.list_complete(kept))
    assert rundir.find_checkpoint(kept) == kept / "step_00005000"  # vit-export and vit-transfer reach them

    assert rundir.set_aside_earlier(tmp_path) == tmp_path / "earlier-2"  # a second fresh start
    assert rundir.set_aside_earlier(tmp_path) is None and rundir.list_complete(tmp_path) == []
