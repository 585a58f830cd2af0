"""A checkpoint folder that fills up mid-save, on a real tmpfs: the run ends with one line naming
the folder, what was free and what a checkpoint needs, and the last complete checkpoint, which
verifies; the half-written checkpoint is gone; with room again the same command resumes.

The tmpfs lives in a private mount namespace of the job (``unshare``), so it exists only for the
job's commands and disappears with them, whatever happens to the test."""
import os
import shutil
import subprocess
import sys

import pytest
from dist_utils import REPO, job_env

pytestmark = pytest.mark.slow

# 7 MB: one checkpoint of the tiny job (4.8 MB at ZeRO-1: weights and Adam's moments) fits, a second not
SCRIPT = r"""
set -u
mount -t tmpfs -o size=7m tmpfs "$CKPT"
"$PY" -m pretrain.train "$@" > "$OUT/first.log" 2>&1; echo $? > "$OUT/first.rc"
ls "$CKPT" > "$OUT/listing"
"$PY" -c "import sys; from pretrain.checkpointing import rundir; \
c = rundir.latest_complete(sys.argv[1]); print(c, rundir.verify(c))" "$CKPT" > "$OUT/verify" 2>&1
mount -o remount,size=64m "$CKPT"
"$PY" -m pretrain.train "$@" > "$OUT/second.log" 2>&1; echo $? > "$OUT/second.rc"
"""


def test_disk_full_mid_save_keeps_the_last_checkpoint_and_resumes(tiny_run, tmp_path):
    unshare = shutil.which("unshare")
    assert unshare, "util-linux's unshare is needed for a private tmpfs"
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    ns = [unshare, "-m"] if os.geteuid() == 0 else [unshare, "-rm"]
    args = tiny_run(f"checkpoint.dir={ckpt}", "zero.stage=1", "train.steps=6", "checkpoint.every_steps=2",
                    "checkpoint.keep_last=1").args()
    r = subprocess.run([*ns, "bash", "-c", SCRIPT, "job", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env=job_env(CKPT=str(ckpt), OUT=str(out), PY=sys.executable))
    assert r.returncode == 0, r.stderr[-2000:]
    first = (out / "first.log").read_text()
    assert (out / "first.rc").read_text().strip() == "2", first[-3000:]
    line = first.strip().splitlines()[-1]
    assert line.startswith(f"vit-train: error: cannot save checkpoint step_00000004 in {ckpt} (No space left on "
                           "device): "), first[-3000:]
    assert " MB free, a checkpoint needs about " in line
    assert f"the last complete checkpoint is {ckpt}/step_00000002 (verified)" in line
    assert "Traceback" not in first
    steps = [n for n in (out / "listing").read_text().split() if n.startswith("step_")]
    assert steps == ["step_00000002"]  # no half-written step 4 left behind
    assert (out / "verify").read_text().strip() == f"{ckpt}/step_00000002 None"
    second = (out / "second.log").read_text()
    assert (out / "second.rc").read_text().strip() == "0", second[-3000:]
    assert "resuming from step 2" in second and "done at step 6" in second
    assert not any(ckpt.iterdir())  # the tmpfs was the job's own: nothing of it is left here
