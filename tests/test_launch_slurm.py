"""`vit-launch slurm`: the sbatch script is valid bash, turns SLURM_JOB_NODELIST into a hostfile the
runner accepts, and starts the runner with the right layout. The script really runs under bash
in DRY_RUN mode; only `scontrol` (SLURM itself, absent here) is stood in for by a tiny script."""
import os
import shlex
import subprocess

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
              *extra, "optim.lr=3e-4"])
    assert e.value.code == 0, capsys.readouterr().err
    return out


def dry_run_script(tmp_path, script):
    """Run the script as sbatch would on the first node, with a stand-in scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    # `scontrol show hostnames gpu[07-08]` prints one host per line
    fake.write_text('#!/bin/bash\n[[ "$1 $2 $3" == "show hostnames gpu[07-08]" ]] && printf "gpu07\\ngpu08\\n"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", DRY_RUN="1", SLURM_JOB_NODELIST="gpu[07-08]",
               SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_CPUS_ON_NODE="32")
    env.pop("MASTER_PORT", None)
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


def test_pdsh_script_builds_hostfile_and_runs_the_runner_on_the_first_node(tmp_path, capsys):
    lines = dry_run_script(tmp_path, write_script(tmp_path, capsys))
    hostfile = tmp_path / "logs" / "hostfile.4242"
    assert hostfile.read_text() == "gpu07 slots=4\ngpu08 slots=4\n"
    assert [h.name for h in parse_hostfile(hostfile)] == ["gpu07", "gpu08"]
    assert dict(_parse_hostfile(hostfile.read_text().splitlines())) == {"gpu07": 4, "gpu08": 4}
    check, launch = (shlex.split(x) for x in lines)
    assert check[1:5] == ["-m", "launch", "check", "--config"] and str(hostfile) in check
    a = runner_parse_args(launch[1:])
    assert (a.hostfile, a.num_nodes, a.num_gpus, a.master_addr) == (str(hostfile), 2, 4, "gpu07")
    assert a.master_port == 20000 + 4242 % 20000  # per job: two jobs sharing a node do not collide
    assert not a.no_ssh and a.user_script == "pretrain.train"
    assert a.user_args[-1] == "optim.lr=3e-4" and a.user_args[1].endswith("configs/tiny_cpu.yaml")
    # pdsh only forwards NCCL*/PYTHON*/... variables: the rest reach other nodes via DS_ENV_FILE
    env_file = tmp_path / "logs" / "deepspeed_env.4242"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in env_file.read_text().splitlines()
    assert "OMP_NUM_THREADS=8" in env_file.read_text().splitlines()  # 32 CPUs / 4 ranks


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
