"""`vit-launch slurm`: the sbatch script is valid bash, turns SLURM_JOB_NODELIST into a hostfile the
runner accepts, and starts the runner with the right layout. The script really runs under bash
in DRY_RUN mode; only `scontrol` (SLURM itself) is stood in for by a tiny script here. Real sbatch
jobs (CPU-only, requeue) run in tests/cluster (`make test-cluster`)."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import time

import pytest
from deepspeed.launcher.runner import _parse_hostfile
from deepspeed.launcher.runner import parse_args as runner_parse_args

from launch.cli import main
from launch.hostfile import parse_hostfile

CONFIG = "configs/tiny_cpu.yaml"


def write_script(tmp_path, capsys, *extra):
    out = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", CONFIG, "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu",
              "--time", "1-12:00:00", "--log-dir", str(tmp_path / "logs"), "--output", str(out),
              *extra, "train.micro_batch_size=8", "optim.lr=3e-4"])  # 64 = 8 x 8 ranks
    assert e.value.code == 0, capsys.readouterr().err
    return out


def write_new(tmp_path, capsys, *args):
    """`vit-launch slurm` with the options launch/commands/slurm.py adds (CPU-only, requeue)."""
    out = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", CONFIG, "--log-dir", str(tmp_path / "logs"), "--output", str(out), *args])
    assert e.value.code == 0, capsys.readouterr().err
    return out


def dry_run_script(tmp_path, script, nodes=("gpu07", "gpu08"), cpus=32, **extra_env):
    """Run the script as sbatch would on the first node, with a stand-in scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    # `scontrol show hostnames gpu[07-08]` prints one host per line
    fake.write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "%s\\n" ' + " ".join(nodes) + "\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", DRY_RUN="1", SLURM_JOB_NODELIST="gpu[07-08]",
               SLURM_JOB_ID="4242", SLURM_NNODES=str(len(nodes)), SLURM_CPUS_ON_NODE=str(cpus))
    env.pop("MASTER_PORT", None)
    env.update(extra_env)
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


def test_script_header_and_syntax(tmp_path, capsys):
    script = write_script(tmp_path, capsys)
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1-12:00:00",
                 'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
                 'export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"'):
        assert line in text.splitlines() or line in text, line
    assert os.access(script, os.X_OK)


def runner_argv(launch):
    """The deepspeed runner argv that the script's `vit-launch run ...` line becomes (its --dry-run)."""
    r = subprocess.run([*launch, "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout.strip().splitlines()[-1])


def test_pdsh_script_builds_hostfile_and_runs_the_runner_on_the_first_node(tmp_path, capsys):
    store = dict(AWS_ENDPOINT_URL_S3="http://minio.internal:9000", AWS_DEFAULT_REGION="us-east-1",
                 AWS_SECRET_ACCESS_KEY="not-to-be-written")
    lines = dry_run_script(tmp_path, write_script(tmp_path, capsys), **store)
    hostfile = tmp_path / "logs" / "hostfile.4242"
    assert hostfile.read_text() == "gpu07 slots=4\ngpu08 slots=4\n"
    assert [h.name for h in parse_hostfile(hostfile)] == ["gpu07", "gpu08"]
    assert dict(_parse_hostfile(hostfile.read_text().splitlines())) == {"gpu07": 4, "gpu08": 4}
    check, launch = (shlex.split(x) for x in lines)
    assert check[1:5] == ["-m", "launch", "check", "--config"] and str(hostfile) in check
    # the script starts our supervisor, `vit-launch run` (python -m launch run), with the hostfile
    assert launch[1:4] == ["-m", "launch", "run"] and "--skip-checks" in launch
    a = runner_parse_args(runner_argv(launch)[1:])
    assert (a.hostfile, a.num_nodes, a.num_gpus, a.master_addr) == (str(hostfile), 2, 4, "gpu07")
    assert a.master_port == 20000 + 4242 % 20000  # per job: two jobs sharing a node do not collide
    assert not a.no_ssh and a.user_script == "pretrain.train"
    assert a.user_args[-1] == "optim.lr=3e-4" and a.user_args[1].endswith("configs/tiny_cpu.yaml")
    # pdsh only forwards NCCL*/PYTHON*/... variables: the rest reach other nodes via DS_ENV_FILE
    env_file = tmp_path / "logs" / "deepspeed_env.4242"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in env_file.read_text().splitlines()
    assert "OMP_NUM_THREADS=8" in env_file.read_text().splitlines()  # 32 CPUs / 4 ranks
    # where the S3 store is reaches every node; its secret does not go into a file
    assert {"AWS_ENDPOINT_URL_S3=http://minio.internal:9000", "AWS_DEFAULT_REGION=us-east-1"} <= set(
        env_file.read_text().splitlines())
    assert "not-to-be-written" not in env_file.read_text() and env_file.stat().st_mode & 0o077 == 0


def test_log_folder_is_created_when_the_script_is_written(tmp_path, capsys):
    """SLURM opens --output before the script runs: a missing folder is JobLaunchFailure."""
    script = write_script(tmp_path, capsys)
    assert (tmp_path / "logs").is_dir()
    assert f"#SBATCH --output={tmp_path / 'logs'}/%x-%j.out" in script.read_text().splitlines()


def test_cpu_only_job_asks_for_no_gpu_and_runs_locally_on_one_node(tmp_path, capsys):
    script = write_new(tmp_path, capsys, "--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "2",
                       "--cpus-per-node", "8", "optim.lr=3e-4")
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "#SBATCH --cpus-per-task=8" in text.splitlines() and "#SBATCH --ntasks-per-node=1" in text.splitlines()
    for gpu_line in ("--gpus-per-node=", "--gres", "--exclusive"):
        assert not any(line.startswith("#SBATCH") and gpu_line in line for line in text.splitlines()), gpu_line
    assert "#SBATCH --requeue" not in text and "scontrol requeue" not in text
    lines = dry_run_script(tmp_path, script, nodes=("cpu01",), cpus=8)
    assert (tmp_path / "logs" / "hostfile.4242").read_text() == "cpu01 slots=2\n"
    check, launch = (shlex.split(x) for x in lines)
    assert check[check.index("--gpus-per-node") + 1] == "2"
    assert "--hostfile" not in launch  # one node: no ssh, the ranks start here inside the job step
    argv = runner_argv(launch)
    assert "--hostfile" not in argv
    a = runner_parse_args(argv[1:])
    assert a.num_gpus == 2 and a.user_script == "pretrain.train"
    env_file = tmp_path / "logs" / "deepspeed_env.4242"
    assert "OMP_NUM_THREADS=4" in env_file.read_text().splitlines()  # 8 CPUs / 2 ranks


def test_requeue_signals_the_batch_shell_which_forwards_to_the_job(tmp_path, capsys):
    script = write_new(tmp_path, capsys, "--nodes", "2", "--gpus-per-node", "8", "--requeue",
                       "--signal-grace", "300", "train.micro_batch_size=4")  # 64 = 4 x 16 ranks
    text = script.read_text().splitlines()
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR1@300",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive"):
        assert line in text, line
    body = "\n".join(text)
    # the launcher runs in its own process group in the background; the trap forwards TERM to it
    assert "trap forward TERM INT" in body and "trap time_limit USR1" in body
    assert 'kill -TERM -- -"$JOB_PID"' in body
    assert 'setsid bash -c "$JOB" "$EXIT_FILE" "${LAUNCH[@]}" &' in body and 'wait "$JOB_PID"' in body
    # exit 69, the shard store away past data.remote_retry_s, or 75 at the time limit: requeued
    assert '    scontrol requeue "$SLURM_JOB_ID"' in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.parametrize("args, message", [
    (["--gpus-per-node", "-1"], "--gpus-per-node must be 0 (CPU-only) or more"),
    (["--gpus-per-node", "4", "--ranks-per-node", "2"], "one rank per GPU"),
    (["--gpus-per-node", "0", "--ranks-per-node", "4", "--cpus-per-node", "2"], "fewer than the 4 rank(s)"),
    (["--gpus-per-node", "0", "--requeue", "--signal-grace", "0"], "--signal-grace must be a positive"),
    # a limit inside the grace: signalled at the start, requeued, signalled again, without end
    (["--gpus-per-node", "0", "--requeue", "--time", "0:01:00"], "--time 0:01:00 is no longer than --signal-grace 120"),
    (["--gpus-per-node", "0", "--requeue", "--time", "1-0", "--signal-grace", "86400"], "--time 1-0 is no longer"),
    (["--gpus-per-node", "0", "--master-port", "0"], "--master-port must be in 1-65535, got 0"),
    (["--gpus-per-node", "0", "--job-name", "my run"], "--job-name 'my run': a name in an #SBATCH line takes no"),
    (["--gpus-per-node", "0", "--partition", "gpu a100"], "--partition 'gpu a100': a name in an #SBATCH line"),
    (["--gpus-per-node", "0", "--account", "lab#2"], "--account 'lab#2': a name in an #SBATCH line"),
])
def test_bad_options_are_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", CONFIG, "--nodes", "1", "--output", str(tmp_path / "j.sbatch"), *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_time_limits_in_every_slurm_format_are_read_as_seconds():
    """sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, and days-hours[:minutes[:seconds]]."""
    from launch.sbatch import SLURM_TIME, time_seconds

    for text, seconds in (("90", 5400), ("5:30", 330), ("4:00:00", 14400), ("1-2", 93600), ("1-2:30", 95400),
                          ("2-00:00:00", 172800), ("0:02:01", 121)):
        assert SLURM_TIME.match(text) and time_seconds(text) == seconds, text


def test_names_and_folders_with_spaces_are_one_word_of_their_sbatch_lines(tmp_path, capsys):
    """sbatch ends an #SBATCH word at an unquoted space and cuts the line at #: the default job name
    has them replaced, the log folder is quoted (sbatch takes the quotes out; real jobs with such a
    folder run in tests/cluster), and the printed submit command is one shell word."""
    config = tmp_path / "my run's#2.yaml"
    config.write_text(open(CONFIG).read())
    out = tmp_path / "my jobs" / "job.sbatch"
    out.parent.mkdir()
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", str(config), "--nodes", "1", "--gpus-per-node", "0", "--output", str(out),
              "--log-dir", str(tmp_path / "job logs")])
    assert e.value.code == 0, capsys.readouterr().err
    lines = out.read_text().splitlines()
    assert "#SBATCH --job-name=vitscale-my_run_s_2" in lines
    assert f'#SBATCH --output="{tmp_path}/job logs/%x-%j.out"' in lines
    assert capsys.readouterr().out.rstrip().endswith(f"submit with: sbatch {shlex.quote(str(out))}")
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def test_srun_script_starts_one_runner_per_node_without_ssh(tmp_path, capsys):
    lines = dry_run_script(tmp_path, write_script(tmp_path, capsys, "--launcher", "srun"))
    srun = shlex.split(lines[1])
    assert srun[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    # bash -c 'exec "$0" --node_rank "$SLURM_NODEID" "$@"' deepspeed ...: what each node runs
    assert srun[4:6] == ["bash", "-c"] and "--node_rank \"$SLURM_NODEID\"" in srun[6]
    per_node = [srun[7], "--node_rank", "1", *srun[8:]]
    a = runner_parse_args(per_node[1:])
    assert a.no_ssh and a.node_rank == 1 and (a.num_nodes, a.num_gpus, a.master_addr) == (2, 4, "gpu07")
    assert a.user_script == "pretrain.train"


@pytest.mark.parametrize("layout, needle", [
    # vit_h14_jft's old micro batch 32 on its documented 32 x 8 GPUs: 4096 % (32 x 256) != 0
    (["--config", "configs/vit_h14_jft.yaml", "--nodes", "32", "--gpus-per-node", "8", "train.micro_batch_size=32"],
     "batch: train.global_batch_size=4096 is not divisible by train.micro_batch_size x world size = 32 x 256 = 8192"),
    (["--config", CONFIG, "--nodes", "3", "--gpus-per-node", "0", "--ranks-per-node", "1"],
     "batch: train.global_batch_size=64 is not divisible by train.micro_batch_size x world size = 32 x 3 = 96"),
])
def test_a_layout_that_cannot_run_writes_no_script(tmp_path, capsys, layout, needle):
    out = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as e:
        main(["slurm", *layout, "--log-dir", str(tmp_path / "logs"), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("vit-launch slurm: error: batch: ") and needle in err[0], err
    assert not out.exists() and not (tmp_path / "logs").exists()  # nothing to submit, nothing half-made


def test_memory_over_the_device_warns_and_still_writes(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", "configs/vit_h14_jft.yaml", "--nodes", "1", "--gpus-per-node", "8",
              "--gpu-memory-gb", "16", "train.micro_batch_size=512", "train.activation_checkpointing=false",
              "--log-dir", str(tmp_path / "logs"), "--output", str(out)])
    o, err = capsys.readouterr()
    assert e.value.code == 0 and out.exists()
    (line,) = err.strip().splitlines()
    assert line.startswith("vit-launch slurm: warning: memory: estimated") and "exceeds 15.2 GB, 95 % of 16 GB" in line


@pytest.mark.parametrize("launcher", ["pdsh", "srun"])
@pytest.mark.parametrize("restarts", ["0", "1"])
def test_a_requeued_job_resumes_even_when_its_first_run_did_not(tmp_path, capsys, restarts, launcher):
    """A fresh start (checkpoint.resume=false) sets the checkpoints aside; a requeue must not."""
    script = write_new(tmp_path, capsys, "--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "2",
                       "--launcher", launcher, "--requeue", "checkpoint.resume=false")
    launch = shlex.split(dry_run_script(tmp_path, script, nodes=("cpu01",), SLURM_RESTART_COUNT=restarts)[-1])
    assert launch[-1] == ("checkpoint.resume=true" if restarts == "1" else "checkpoint.resume=false")


# a stand-in for `vit-launch run`: checkpoints (here: nothing) and exits 75 on SIGTERM, as the job does
STOPS_WITH_75 = "bash -c 'trap \"exit 75\" TERM; touch \"$0\"; while :; do sleep 0.1; done' \"$STARTED\""


def start_end_block(tmp_path, job: str, started, slow_trap: bool = False, status_file=None,
                    tools=None) -> subprocess.Popen:
    """The script's end (``start_block``, requeue on, log folder ``tmp_path``) around ``job`` as job
    77, started in bash with a stand-in scontrol that logs to ``tmp_path/scontrol.log``; ``$STARTED``
    is ``started``. ``slow_trap``: a stand-in date taking 0.5 s, so the script's trap (its log line)
    runs that long. ``status_file``: as ``start_block``'s (srun). ``tools``: more stand-ins, name: body."""
    from launch.slurm import start_block

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tools = {"scontrol": f'echo "$@" >> {tmp_path / "scontrol.log"}', **(tools or {})}
    if slow_trap:
        tools["date"] = f'sleep 0.5\nexec {shutil.which("date")} "$@"'
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "end.sh"
    script.write_text("set -euo pipefail\n" + start_block(job, "true", 2, requeue=True, logs=shlex.quote(str(tmp_path)),
                                                         status_file=status_file and str(status_file)) + "\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77", STARTED=str(started))
    env.pop("DRY_RUN", None)
    return subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_a_stop_at_the_time_limit_is_requeued_and_a_scancel_is_not(tmp_path, sig, requeued):
    """--signal=B:USR1@grace: the script forwards SIGTERM, the job checkpoints and exits 75, and the
    script requeues it (SLURM's --requeue does not cover a job's own exit); scancel's SIGTERM ends in
    75 as well, and stays ended."""
    started = tmp_path / "started"
    proc = start_end_block(tmp_path, STOPS_WITH_75, started)
    end = time.monotonic() + 20
    while not started.exists() and time.monotonic() < end:
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait(timeout=20) == 75, proc.stderr.read()
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 77\n" if requeued else "")


# exits at once on SIGTERM, its PID in $STARTED
EXITS_AT_ONCE = "bash -c 'trap \"exit 75\" TERM; echo $$ > \"$0\"; while :; do :; done' \"$STARTED\""


def test_a_job_that_ends_during_the_scripts_trap_keeps_its_own_exit_status(tmp_path):
    """scancel signals every process of the job, the ranks with the batch script: a job that ends
    while the script's trap still runs was reported with 128 + the signal (143), not its own 75,
    because the trap ends `wait` early; the script now waits again for the job's own status."""
    for attempt in range(3):
        started = tmp_path / f"started{attempt}"
        proc = start_end_block(tmp_path, EXITS_AT_ONCE, started, slow_trap=True)
        end = time.monotonic() + 20
        while not (started.exists() and started.read_text().strip()) and time.monotonic() < end:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)  # the batch script: its trap runs 0.5 s
        time.sleep(0.2)
        os.killpg(os.getpgid(int(started.read_text())), signal.SIGTERM)  # the job's processes, as scancel's
        assert proc.wait(timeout=20) == 75, (attempt, proc.stderr.read())
    assert not (tmp_path / "scontrol.log").exists()  # scancel: ended, not requeued


def test_the_job_records_its_own_exit_code_and_leaves_its_launchers_signals_alone(tmp_path):
    """The job's wrapper writes the launcher's exit code beside the log; the launcher gets TERM and
    USR1 with their default action (a signal the wrapper ignored would be inherited, and SIGTERM to
    the process group would no longer stop the ranks)."""
    started = tmp_path / "started"
    job = "bash -c 'grep SigIgn /proc/$$/status > \"$0\"; exit 5' \"$STARTED\""
    assert start_end_block(tmp_path, job, started).wait(timeout=20) == 5
    assert (tmp_path / "exit.77").read_text() == "5\n"
    ignored = int(started.read_text().split()[1], 16)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        assert not ignored & (1 << (sig - 1)), (sig.name, hex(ignored))


def test_the_recorded_exit_code_stands_when_bash_loses_the_jobs_status(tmp_path):
    """bash can lose a background job's status when the job ends just as a trap runs: `wait` then
    gives 127 or 255, or the trap's 143 stands, and a job that should be requeued is not. Here a
    stand-in setsid loses it every time (it runs the real one and exits 255): the job ends 69 (the
    shard store stayed away), recorded by its wrapper, and is requeued."""
    tools = {"setsid": f'{shutil.which("setsid")} "$@"\nexit 255'}
    proc = start_end_block(tmp_path, "bash -c 'exit 69'", tmp_path / "started", tools=tools)
    assert proc.wait(timeout=20) == 69, proc.stderr.read()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"


def test_a_killed_wrapper_leaves_waits_status_not_an_earlier_attempts_code(tmp_path):
    """A requeued job keeps its job id, so its earlier attempt's code file has the same name: the
    script removes it before the start, and where the wrapper itself is killed (no code written),
    `wait`'s 137 stands, not the earlier 0."""
    (tmp_path / "exit.77").write_text("0\n")
    proc = start_end_block(tmp_path, "bash -c 'kill -KILL $PPID'", tmp_path / "started")
    assert proc.wait(timeout=20) == 137, proc.stderr.read()
    assert not (tmp_path / "exit.77").exists()


@pytest.mark.parametrize("status, code", [
    (None, 1),  # no status.json: srun's code
    ({"state": "interrupted", "exit_code": 75}, 75),
    ({"state": "failed", "exit_code": 2}, 2),
    ({"state": "running", "exit_code": None}, 1),  # rank 0 never said how it ended
    ({"state": "interrupted", "exit_code": 75, "time": 1.0}, 1),  # an earlier attempt's
    ("{not json", 1),
])
def test_an_srun_job_exits_with_the_code_in_this_attempts_status_json(tmp_path, status, code):
    """Under srun the script takes the run's exit code from status.json when this attempt wrote it
    and the run has ended (`python -m launch.supervise exit-code`), and srun's otherwise."""
    path = tmp_path / "status.json"
    if isinstance(status, dict):
        path.write_text(json.dumps({"time": time.time() + 3600, **status}))  # after the script starts
    elif status is not None:
        path.write_text(status)
    proc = start_end_block(tmp_path, "bash -c 'exit 1'", tmp_path / "started", status_file=path)
    assert proc.wait(timeout=60) == code, proc.stderr.read()


def test_an_srun_attempts_start_counts_to_the_fraction_of_a_second(tmp_path):
    """A requeued attempt that starts in the second the one before it ended (its status.json
    written at 1000.5 s, this start at 1000.9 s) does not take that attempt's code for its own: the
    start was read in whole seconds (1000), and a requeue whose srun failed at once took the earlier
    stop's 75 and was requeued again."""
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"state": "interrupted", "exit_code": 75, "time": 1000.5}))
    clock = ('case "$1" in +%s) echo 1000 ;; +%s.%N) echo 1000.900000000 ;; '
             f'*) exec {shutil.which("date")} "$@" ;; esac')
    proc = start_end_block(tmp_path, "bash -c 'exit 1'", tmp_path / "started", status_file=path,
                           tools={"date": clock})
    assert proc.wait(timeout=60) == 1, proc.stderr.read()


# a stand-in for srun: the job checkpoints on SIGTERM (rank 0 writes status.json: interrupted, 75)
# and the deepspeed runner under srun ends with its launcher's code for a signalled job, 1
SRUN_STOPS_WITH_1 = """#!/bin/bash
trap 'printf "{{\\"state\\": \\"interrupted\\", \\"step\\": 4, \\"time\\": %s, \\"exit_code\\": 75}}" \\
  "$(date +%s.%N)" > {status}; exit 1' TERM
touch {started}
while :; do sleep 0.1; done
"""


def test_an_srun_job_stopped_at_the_time_limit_exits_with_the_runs_code_and_is_requeued(tmp_path, capsys, shards):
    """Under srun the script waits for srun, whose code is the runner's (1 for a signalled job), not
    the run's 75: the script read it as a failure and never requeued a stop at the time limit."""
    run = tmp_path / "run"
    script = write_new(tmp_path, capsys, "--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node", "2",
                       "--launcher", "srun", "--requeue", f"data.train_shards={shards}", f"train.output_dir={run}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started = tmp_path / "started"
    (bin_dir / "srun").write_text(SRUN_STOPS_WITH_1.format(status=run / "status.json", started=started))
    (bin_dir / "scontrol").write_text('#!/bin/bash\nif [[ "$1 $2" == "show hostnames" ]]; then echo cpu01; '
                                      f'else echo "$@" >> {tmp_path / "scontrol.log"}; fi\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    run.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="cpu01", SLURM_JOB_ID="4242",
               SLURM_NNODES="1", SLURM_CPUS_ON_NODE="2")
    env.pop("DRY_RUN", None)
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    end = time.monotonic() + 60  # the pre-flight checks run first
    while not started.exists() and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 75, proc.communicate()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
