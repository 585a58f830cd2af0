"""`vit-launch slurm --shards` on the one-machine SLURM of conftest.py: the job array writes the
parts of a vit-shards job (its tasks at once, one CPU each), the merge job runs after the whole
array (``--dependency=afterok``), and the merged shards hold the samples, labels and keys one
process writes."""
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, wait_until
from shard_utils import samples_of  # tests/ is on sys.path (conftest.py)

from data_pipeline.shards.cli import main as vit_shards

pytestmark = pytest.mark.cluster

DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
SHARDS = ["--source", "demo", "--limit", "90", "--shard-size", "8"]


def _env(slurm) -> dict:
    env = {**os.environ, **slurm.env, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    env.pop("OMP_NUM_THREADS", None)
    return env


def _sbatch(slurm, *args) -> str:
    r = subprocess.run(["sbatch", "--parsable", *map(str, args)], cwd=REPO, env=_env(slurm), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"sbatch: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def _states(slurm, job_id) -> list[str]:
    """JobState of a job, or of each task of an array job."""
    out = slurm.cmd("scontrol", "show", "job", "-o", job_id, check=False)
    return [line.split("JobState=")[1].split()[0] for line in out.splitlines() if "JobState=" in line]


def _wait_done(slurm, job_id, logs, count=1):
    def done():
        states = _states(slurm, job_id)
        return len(states) == count and all(st in DONE for st in states)
    try:
        wait_until(done, 300, f"job {job_id}", 1)
    except AssertionError as e:
        text = "\n".join(p.read_text()[-2000:] for p in sorted(logs.glob("*.out")))
        raise AssertionError(f"{e}: {_states(slurm, job_id)}\n{text}\n{slurm.log()[-3000:]}") from None
    return _states(slurm, job_id)


def test_job_array_parts_then_dependent_merge_equal_one_process(slurm, tmp_path):
    """Part 2 fails the first time (its progress file's path is taken by a folder): parts 1 and 3
    finish, the merge never starts (its dependency cannot be met). Then, as the script's header
    says, part 2 alone is submitted again with the merge after it: part 1's and 3's files are not
    touched, and the merged shards equal one process's."""
    # a log folder with a space: sbatch reads the quoted #SBATCH --output line by its own rules
    out, logs, script = tmp_path / "shards", tmp_path / "job logs", tmp_path / "shards.sbatch"
    r = subprocess.run([sys.executable, "-m", "launch", "slurm", "--shards", "--parts", "3", "--cpus-per-node", "1",
                        "--job-name", "shards-test", "--log-dir", str(logs), "--output", str(script), "--",
                        *SHARDS, "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    merge = tmp_path / "shards.merge.sbatch"
    assert f"sbatch --dependency=afterok:$(sbatch --parsable {script}) {merge}" in r.stdout
    assert "#SBATCH --array=1-3" in script.read_text() and logs.is_dir()
    blocker = out / ".vit-shards-progress-0002of0003.json"
    blocker.mkdir(parents=True)

    ids = []
    try:
        array_id = _sbatch(slurm, script)
        merge_id = _sbatch(slurm, f"--dependency=afterok:{array_id}", merge)
        ids += [array_id, merge_id]
        assert sorted(_wait_done(slurm, array_id, logs, 3)) == ["COMPLETED", "COMPLETED", "FAILED"]
        failed = (logs / f"shards-test-{array_id}_2.out").read_text()
        assert f"vit-shards: error: {blocker}" in failed, failed
        time.sleep(3)  # SLURM marks the dependency as never satisfied at its next scheduling pass
        info = slurm.job(merge_id)
        assert info.get("JobState") == "PENDING" and info.get("Reason", "").startswith("Dependency"), info
        slurm.cmd("scancel", merge_id)
        done = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if "0002of" not in p.name}

        blocker.rmdir()
        again = _sbatch(slurm, "--array=2", script)
        merge_id = _sbatch(slurm, f"--dependency=afterok:{again}", merge)
        ids += [again, merge_id]
        assert _wait_done(slurm, merge_id, logs) == ["COMPLETED"], slurm.job(merge_id)
        assert _states(slurm, again) == ["COMPLETED"]
        merge_log = (logs / f"shards-test-merge-{merge_id}.out").read_text()
        assert "90 samples in" in merge_log and "of 3 parts" in merge_log, merge_log
        assert {n: t for n, t in ((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) if n in done} == done
    finally:
        for j in ids:
            slurm.cmd("scancel", j, check=False)

    one = tmp_path / "one"
    assert vit_shards([*SHARDS, "--output", str(one), "--quiet"]) == 0
    assert samples_of(out) == samples_of(one)
    assert {p.name for p in out.glob("part-*.json")} == {f"part-000{i}of0003.json" for i in (1, 2, 3)}
