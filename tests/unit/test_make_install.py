"""`make install` (the README's first step, about 3 minutes the first time) says what it is doing:
a line per stage, and pip's own progress instead of ``pip -q``'s silence. Read with ``make -n`` (the
recipe as make would run it, nothing run) for a venv that does not exist."""
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_install_says_each_stage_and_shows_pips_progress(tmp_path):
    venv = tmp_path / ".venv"
    r = subprocess.run(["make", "-n", "install", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    said = [i for i, ln in enumerate(lines) if ln.startswith('echo "make install: ')]
    pip = [i for i, ln in enumerate(lines) if "-m pip install" in ln and "-e '.[test]'" in ln]
    assert len(pip) == 1 and " -q" not in lines[pip[0]], lines  # pip's lines (collecting, downloading) show
    assert "creating" in r.stdout and len(said) >= 3, lines  # the venv, then each stage
    assert any(i < pip[0] and "installing vitscale" in lines[i] for i in said), lines
    assert "done" in lines[said[-1]] and said[-1] > pip[0], lines
    # DeepSpeed's CPU op is built by the install, not by the first training job
    build = [i for i, ln in enumerate(lines) if "build_shm_op()" in ln]
    assert len(build) == 1 and pip[0] < build[0] < said[-1], lines
