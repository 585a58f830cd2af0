"""``vit-launch slurm --shards --parts N --output shards.sbatch -- VIT-SHARDS OPTIONS``: shard
writing as a SLURM job array whose task I runs ``vit-shards ... --part I/N``, and
``shards.merge.sbatch``, the ``vit-shards merge`` to submit with ``--dependency=afterok`` on the
array. No training config is read."""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launch.hostfile import LaunchError
from launch.sbatch import SLURM_TIME, bash_array, check_header_names, header_path


@dataclass
class ShardsJob:
    """``vit-shards`` as a SLURM job array of ``parts`` tasks (task I runs ``--part I/parts``) and a
    merge job that depends on the whole array (``afterok``)."""
    parts: int
    shard_args: list[str]  # vit-shards options (its --output among them), without --part
    partition: Optional[str] = None
    time: Optional[str] = None
    account: Optional[str] = None
    job_name: str = "vit-shards"
    cpus_per_task: Optional[int] = None  # also vit-shards --workers unless the options name it
    max_running: Optional[int] = None  # array tasks at once (SLURM's --array=1-N%K)
    log_dir: str = "logs"


def merge_script_path(output: str | Path) -> Path:
    """``shards.sbatch`` -> ``shards.merge.sbatch``: the dependent merge job beside the array."""
    out = Path(output)
    return out.with_name(f"{out.stem}.merge{out.suffix or '.sbatch'}")


def render_shards(job: ShardsJob, output: str = "shards.sbatch", cwd: Optional[Path] = None) -> tuple[str, str]:
    """The array script and the merge script, as text. The vit-shards options are checked with
    vit-shards' own parser (a mistake is one line, exit 2, before any script is written)."""
    from data_pipeline.shards import cli as ws

    if job.parts <= 0:
        raise LaunchError(f"--parts must be a positive number, got {job.parts}")
    if job.time is not None and not SLURM_TIME.match(job.time):
        raise LaunchError(f"--time {job.time!r}: use a SLURM time such as 90, 4:00:00 or 2-00:00:00")
    if job.max_running is not None and job.max_running <= 0:
        raise LaunchError(f"--max-running must be a positive number, got {job.max_running}")
    if job.cpus_per_task is not None and job.cpus_per_task <= 0:
        raise LaunchError(f"--cpus-per-node must be a positive number, got {job.cpus_per_task}")
    check_header_names(job_name=job.job_name, partition=job.partition, account=job.account)
    args = ws.parse_args(job.shard_args)
    if args.part is not None:
        raise LaunchError("the vit-shards options name --part; the job array gives each task its own part")
    words = [w for w in job.shard_args if w != "--quiet"]
    if job.cpus_per_task and "--workers" not in words:
        words += ["--workers", str(job.cpus_per_task)]
    cwd = (cwd or Path.cwd()).absolute()
    log_dir = (cwd / job.log_dir).absolute()
    logs = shlex.quote(str(log_dir))
    out_dir = shlex.quote(str((cwd / args.output).absolute()))
    merge = merge_script_path(output)
    head = ["#SBATCH --ntasks=1"]
    if job.cpus_per_task:
        head.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    for flag, v in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if v:
            head.append(f"#SBATCH --{flag}={v}")
    throttle = f"%{job.max_running}" if job.max_running else ""
    py = shlex.quote(sys.executable)
    n = job.parts
    submit = f"sbatch --dependency=afterok:$(sbatch --parsable {shlex.quote(str(output))}) {shlex.quote(str(merge))}"
    array = f"""#!/bin/bash
# vit-shards in {n} parts as a SLURM job array (task I writes part I/{n}), written by `vit-launch slurm --shards`.
#   vit-shards options: {" ".join(shlex.quote(w) for w in words)}
# Submit the array, and the merge ({merge.name}) to run once every task has succeeded:
#   {submit}
# A failed task: rerun only it (`sbatch --array=I {output}`; it keeps its finished shards), then
# `sbatch {merge}`. Parts share the --output folder; each writes its own shards and part manifest.
#SBATCH --job-name={job.job_name}
#SBATCH --array=1-{n}{throttle}
{chr(10).join(head)}
#SBATCH --output={header_path(f"{log_dir}/%x-%A_%a.out")}

set -euo pipefail
cd {shlex.quote(str(cwd))}
{bash_array("SHARDS", words)}
echo "$(date -Is) part $SLURM_ARRAY_TASK_ID/{n} on $(hostname)" >&2
exec {py} -m data_pipeline.write_shards "${{SHARDS[@]}}" --part "$SLURM_ARRAY_TASK_ID/{n}" --quiet
"""
    merge_text = f"""#!/bin/bash
# The merge of the {n} parts written by {output} (`vit-launch slurm --shards`): checks every part
# manifest and writes manifest.json. Submitted with --dependency=afterok on the array:
#   {submit}
#SBATCH --job-name={job.job_name}-merge
{chr(10).join(h for h in head if "cpus-per-task" not in h)}
#SBATCH --output={header_path(f"{log_dir}/%x-%j.out")}

set -euo pipefail
cd {shlex.quote(str(cwd))}
mkdir -p {logs}
OUT={out_dir}
PARTS=()
for ((i = 1; i <= {n}; i++)); do PARTS+=("$OUT/$(printf 'part-%04dof%04d.json' "$i" {n})"); done
exec {py} -m data_pipeline.write_shards merge "$OUT" "${{PARTS[@]}}"
"""
    return array, merge_text


def write_shards_job(job: ShardsJob, output: str | Path) -> tuple[Path, Path]:
    """Write the array script and its merge script, and create the log folder (SLURM opens the
    ``--output`` files before a script runs)."""
    out = Path(output)
    if out.parent and not out.parent.is_dir():
        raise LaunchError(f"--output {out}: folder {out.parent} does not exist")
    array, merge = render_shards(job, str(output))
    Path(job.log_dir).absolute().mkdir(parents=True, exist_ok=True)
    written = []
    for path, text in ((out, array), (merge_script_path(out), merge)):
        path.write_text(text)
        path.chmod(0o755)
        written.append(path)
    return written[0], written[1]


def shards_main(argv) -> None:
    """``vit-launch slurm --shards [options] -- VIT-SHARDS OPTIONS``: write the job array + merge."""
    from data_pipeline.errors import DataError, Parser, cli_errors, path_arg

    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, theirs = argv[:cut], argv[cut + 1:]
    ap = Parser(prog="vit-launch slurm --shards", description="Write vit-shards as a SLURM job array of --parts "
                "tasks plus a merge job that depends on it. vit-shards' own options follow `--`.")
    ap.add_argument("--shards", action="store_true", required=True, help="write the shard-writing job array")
    ap.add_argument("--parts", type=int, required=True, help="array tasks, one part of the job each")
    ap.add_argument("--output", required=True, type=path_arg,
                    help="array script to write; the merge goes beside it (NAME.merge.sbatch)")
    ap.add_argument("--partition", help="SLURM partition")
    ap.add_argument("--time", help="time limit per part, e.g. 4:00:00")
    ap.add_argument("--account", help="SLURM account")
    ap.add_argument("--job-name", default="vit-shards", help="default: vit-shards (the merge: NAME-merge)")
    ap.add_argument("--cpus-per-node", type=int, help="CPUs per array task (and vit-shards --workers)")
    ap.add_argument("--max-running", type=int, help="array tasks running at once (default: as SLURM allows)")
    ap.add_argument("--log-dir", default="logs", type=path_arg, help="job output (default logs/; created now)")
    args = ap.parse_args(ours)
    if not theirs:
        ap.error("give vit-shards' options after `--`, e.g. -- --source imagefolder:/data --output /shards")
    job = ShardsJob(parts=args.parts, shard_args=theirs, partition=args.partition, time=args.time,
                    account=args.account, job_name=args.job_name, cpus_per_task=args.cpus_per_node,
                    max_running=args.max_running, log_dir=args.log_dir)
    with cli_errors(ap.prog, DataError, LaunchError, OSError):
        array, merge = write_shards_job(job, args.output)
    print(f"wrote {array} ({job.parts} array tasks) and {merge}; logs in {Path(job.log_dir).absolute()}; "
          f"submit with: sbatch --dependency=afterok:$(sbatch --parsable {shlex.quote(str(array))}) "
          f"{shlex.quote(str(merge))}")
    raise SystemExit(0)
