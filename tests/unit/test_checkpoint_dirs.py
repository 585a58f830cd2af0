"""Which checkpoint of a folder counts (``pretrain/checkpointing/rundir.py``): our tags by their
``COMPLETE`` marker alone, a foreign DeepSpeed run's by ``latest``; a resume's pick keeps
``latest`` on what it picked."""
from pathlib import Path

from pretrain.checkpointing import rundir


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
