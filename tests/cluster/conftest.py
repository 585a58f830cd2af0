"""Real cluster parts on one machine, for the `cluster` tests (`make test-cluster`).

* ``ssh_nodes``: an sshd of our own on a free high port of 127.0.0.1-127.0.0.4 (its own host
  key, a client key made for the session, an authorized_keys only it reads), an ssh client config
  that maps the four addresses (and ``localhost``) to that port, and the environment that makes
  pdsh's ssh module use it (``PDSH_RCMD_TYPE=ssh``, ``PDSH_SSH_ARGS_APPEND=-F <config>``). Nothing
  under ``~/.ssh`` is read or written. A DeepSpeed hostfile ``127.0.0.1 slots=1`` /
  ``127.0.0.2 slots=1`` makes the stock ``deepspeed --hostfile`` start one launcher per "node";
  a node's processes are those of the ssh sessions made to its address.
* ``star_nodes``: four network namespaces on a bridge (``netns.Star``), an sshd inside each on its
  own address, the same keys and client config: nodes whose link a test cuts.
* ``slurm``: munged (its own key, socket, pid, log, seed), slurmctld and slurmd as root with
  their own slurm.conf, state, spool and logs, on free high ports of 127.0.0.1; the client
  commands reach it through ``SLURM_CONF``.

Every daemon is started here, in its own session, and stopped here by PID (SIGTERM, then
SIGKILL), even when a test fails. Needs root (slurmd, munged as user munge) and the Debian
packages openssh-server, pdsh, slurm-wlm, munge; without them the tests are skipped with the
reason (``make test-cluster`` installs them first).
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "tests"))  # dist_utils

from dist_utils import TinyRun, free_port  # noqa: E402


# ----------------------------------------------------------------------------------- processes
def start_daemon(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    """A daemon in the foreground, in its own session (so it and its children can be ended)."""
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, **kw)


def stop(proc: subprocess.Popen | None, grace: float = 10) -> None:
    """SIGTERM the process (by PID), then SIGKILL its session if it is still there after grace."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.3):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def require(*tools: str) -> None:
    missing = [t for t in tools if not shutil.which(t) and not Path(t).exists()]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian: openssh-server pdsh slurm-wlm munge; make test-cluster "
                    "installs them)")
    if os.geteuid() != 0:
        pytest.skip("needs root: slurmd/slurmctld run as root and munged as user munge")


def procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, session id, command line) of every process we can read."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue  # zombies hold no resources; their parent reaps them
        out[int(d.name)] = (int(fields[1]), int(fields[3]), cmd)
    return out


def descendants(root: int, table=None) -> set[int]:
    table = table if table is not None else procs()
    found, todo = set(), [root]
    while todo:
        p = todo.pop()
        for pid, (ppid, _, _) in table.items():
            if ppid == p and pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------ ssh
LOOPBACK_NODES = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")


def ssh_keys(root: Path) -> None:
    """A host key, a client key made for the session and an authorized_keys only our sshd reads."""
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"vitscale-test-{key}",
                        "-f", str(root / key)], check=True)
    shutil.copy(root / "client_key.pub", root / "authorized_keys")


def sshd_config(root: Path, port: int, listen, name: str = "sshd") -> Path:
    """One sshd's config (``<root>/<name>_config``): ``port`` on each address of ``listen``."""
    path = root / f"{name}_config"
    path.write_text(f"Port {port}\n" + "".join(f"ListenAddress {a}\n" for a in listen) + f"""\
HostKey {root}/host_key
AuthorizedKeysFile {root}/authorized_keys
PidFile {root}/{name}.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
PrintMotd no
""")
    return path


def ssh_client(root: Path, port: int, hosts) -> dict:
    """The ssh client config mapping ``hosts`` to ``port`` with the session's key, and the
    environment that makes pdsh's ssh module (the runner's, and vit-launch's probe) use it.
    ``ConnectTimeout`` bounds a connection to a node that does not answer."""
    (root / "ssh_config").write_text(f"""\
Host {' '.join(hosts)}
  Port {port}
  User {pwd.getpwuid(os.getuid()).pw_name}
  IdentityFile {root}/client_key
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  BatchMode yes
  LogLevel ERROR
  ConnectTimeout 5
""")
    return {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {root}/ssh_config"}


def pdsh_answers(hosts, env: dict) -> bool:
    r = subprocess.run(["pdsh", "-S", "-w", ",".join(hosts), "echo ok-%n"], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and all(f"ok-{i}" in r.stdout for i in range(len(hosts)))


def session_pids(daemons) -> set[int]:
    """Processes our sshd(s) started for logins (and everything they started)."""
    table = procs()
    return set().union(*(descendants(d.pid, table) for d in daemons)) if daemons else set()


def node_pids(daemons, host: str) -> set[int]:
    """Every process of node ``host``: those of the ssh sessions made to that address (their
    ``SSH_CONNECTION`` names it as the server's; a rank inherits it from its launcher's shell), and
    their descendants."""
    table = procs()
    found = set()
    for pid in session_pids(daemons):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        conn = next((e.split(b"=", 1)[1].split() for e in env if e.startswith(b"SSH_CONNECTION=")), [])
        if len(conn) == 4 and conn[2].decode() == host:
            found |= {pid} | descendants(pid, table)
    return found


@dataclass
class SshNodes:
    """Nodes reached over pdsh's ssh. ``hostfile``: the first two nodes, one slot each."""
    root: Path
    port: int
    ssh_config: Path
    hostfile: Path
    daemons: list
    env: dict = field(default_factory=dict)  # what the runner (and pdsh, ssh) need in their environment
    hosts: tuple = LOOPBACK_NODES

    @property
    def daemon(self) -> subprocess.Popen:
        return self.daemons[0]

    def session_pids(self) -> set[int]:
        """Processes sshd started for logins (and everything they started)."""
        return session_pids(self.daemons)

    def node_pids(self, host: str) -> set[int]:
        return node_pids(self.daemons, host)

    def write_hostfile(self, path: Path, n: int, slots: int = 1) -> Path:
        """A DeepSpeed hostfile of the first ``n`` nodes, ``slots`` each."""
        path.write_text("".join(f"{h} slots={slots}\n" for h in self.hosts[:n]))
        return path

    def ssh_wrapper(self, folder: Path) -> Path:
        """A folder holding an ``ssh`` that reads our config: the deepspeed runner's own check
        (``ssh HOST hostname``) reads only ssh's default config, which the tests never touch."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {self.ssh_config} \"$@\"\n")
        (folder / "ssh").chmod(0o755)
        return folder


@pytest.fixture(scope="session")
def ssh_nodes(tmp_path_factory):
    """Four "nodes" on 127.0.0.1-127.0.0.4, one sshd listening on all four (module docstring)."""
    require("/usr/sbin/sshd", "ssh", "ssh-keygen", "pdsh")
    root = tmp_path_factory.mktemp("ssh")
    ssh_keys(root)
    port = free_port()
    config = sshd_config(root, port, LOOPBACK_NODES)
    env = ssh_client(root, port, LOOPBACK_NODES + ("localhost",))
    (root / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    # sshd refuses to start without its privilege-separation directory (Debian creates it in
    # the service unit, which we do not use)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    subprocess.run(["/usr/sbin/sshd", "-t", "-f", str(config)], check=True)
    daemon = start_daemon(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], root / "sshd.log")
    nodes = SshNodes(root, port, root / "ssh_config", root / "hostfile", [daemon], env)
    try:
        wait_until(lambda: pdsh_answers(LOOPBACK_NODES, env), 30,
                   f"pdsh over our sshd on port {port} ({root}/sshd.log)")
        yield nodes
    finally:
        kill_pids(nodes.session_pids())
        stop(daemon)


# ---------------------------------------------------------------------------------------- slurm
@dataclass
class Slurm:
    root: Path
    conf: Path
    env: dict
    daemons: list

    def cmd(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        r = subprocess.run(list(args), env={**os.environ, **self.env}, capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, BatchHost, ...)."""
        out = self.cmd("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*")))


def _munge_dir() -> Path:
    """munged runs as user munge and checks every folder of its socket's path is traversable by
    all and not writable by others; pytest's base temp folder is 0700 root, so the munge folder
    is a fresh one under /tmp, removed at teardown."""
    d = Path(tempfile.mkdtemp(prefix="vitscale-munge-"))
    d.chmod(0o755)
    shutil.chown(d, "munge", "munge")
    return d


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    require("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "sbatch", "scontrol", "squeue", "sinfo")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        pytest.skip("no user munge (Debian package munge)")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    daemons: list[subprocess.Popen] = []
    munge = _munge_dir()
    try:
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        sock = munge / "munge.socket"
        daemons.append(start_daemon(  # as user munge, as its service does; our child, so we stop it by PID
            ["/usr/sbin/munged", "--foreground", f"--socket={sock}", f"--key-file={key}",
             f"--log-file={munge}/munged.log", f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed"],
            root / "log" / "munged.out", user="munge", group="munge", extra_groups=[]))
        wait_until(lambda: sock.exists(), 20, f"munged's socket {sock}")
        ctld_port, d_port = free_port(), free_port()
        mem = max(1000, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2)
        conf = root / "slurm.conf"
        conf.write_text(f"""\
# one-machine SLURM of the cluster tests (tests/cluster/conftest.py)
ClusterName=vitscaletest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
# seconds between SIGTERM and SIGKILL when a job is cancelled or requeued: time to checkpoint
KillWait=60
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        env = {"SLURM_CONF": str(conf)}
        full = {**os.environ, **env}
        daemons.append(start_daemon(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(conf)],
                                    root / "log" / "slurmctld.out", env=full))
        daemons.append(start_daemon(["/usr/sbin/slurmd", "-D", "-N", "localhost", "-f", str(conf)],
                                    root / "log" / "slurmd.out", env=full))
        s = Slurm(root, conf, env, daemons)
        try:
            wait_until(lambda: "idle" in s.cmd("sinfo", "-h", "-o", "%T", check=False), 60, "sinfo: node idle")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log()}") from None
        yield s
        # teardown: cancel what is left, then stop the daemons
        s.cmd("scancel", "--full", "--user", pwd.getpwuid(os.getuid()).pw_name, check=False)
        try:
            wait_until(lambda: not s.cmd("squeue", "-h", check=False).strip(), 90, "squeue to empty", 1)
        except AssertionError:
            pass
    finally:
        for d in reversed(daemons):  # slurmd, slurmctld, munged
            stop(d, grace=15)
        shutil.rmtree(munge, ignore_errors=True)


# ------------------------------------------------------------------------------ training runs
def ds_env_file(path: Path, **extra) -> Path:
    """The runner forwards only PYTHON*/NCCL*/UCX*/MV2* variables over pdsh; the rest go through
    DS_ENV_FILE (one KEY=VALUE a line). TMPDIR among them: the ranks' temporary files (W&B's media
    folders, which a killed rank leaves behind) go to the test session's folder, as those of every
    process started here do, and torch.compile's cache stays where the session put it."""
    env = {"PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
           **{k: os.environ[k] for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR") if k in os.environ}, **extra}
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return path


def train_overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny run's overrides (``dist_utils.TinyRun``) as the cluster jobs use them: ViT-Ti, not the
    tiny jobs' test_vit (the bytes each step puts on a link and the timings these tests are sized by
    are ViT-Ti's), micro-batches of 16, one data worker, W&B offline, a line every 5 steps."""
    return TinyRun(shards, run_dir, ("model.name=vit_tiny_patch16_224", "train.global_batch_size=32",
                                     "train.micro_batch_size=16", "data.workers=1", "logging.wandb.mode=offline",
                                     "train.log_every_steps=5", "optim.warmup_steps=5", *extra)).overrides()


@pytest.fixture(scope="session")
def demo_manifest(demo_train):
    return demo_train / "manifest.json"


# ---------------------------------------------------------------------------- network namespaces
@pytest.fixture
def veth_nodes():
    """Two network namespaces joined by a veth pair, 169.254.77.1/30 (A) <-> 169.254.77.2/30 (B)
    (``tests/cluster/netns.py``): the test shapes and cuts the link. Both namespaces, and with them
    the pair and its qdiscs, are deleted at teardown even when the test fails; a test's job fixture
    ends its processes first (it depends on this one, so pytest tears it down before)."""
    from netns import Link, missing

    why = missing()
    if why:
        pytest.skip(why)
    link = Link(str(os.getpid()))
    try:
        yield link.create()
    finally:
        link.remove()
    if link.exists():
        raise AssertionError(f"network namespaces {list(link.ns.values())} still listed after ip netns del")


@pytest.fixture
def star_nodes(tmp_path_factory):
    """Four network namespaces on one switch (``netns.Star``: 169.254.78.1-4), an sshd inside each
    listening on its node's address, one client config for all four (``SshNodes``). The test cuts a
    node's link (``nodes.star.set_link(i, False)``) and starts ``vit-launch`` inside node 0
    (``nodes.star.prefix(0)``). At teardown every login's processes are killed, each sshd stopped by
    PID, and the namespaces deleted (with them the veth pairs and the bridge), even when the test
    fails; a test's job fixture ends its own processes first."""
    from netns import Star, missing

    why = missing()
    if why:
        pytest.skip(why)
    require("/usr/sbin/sshd", "ssh", "ssh-keygen", "pdsh")
    root = tmp_path_factory.mktemp("star")
    ssh_keys(root)
    star = Star(str(os.getpid()))
    daemons: list[subprocess.Popen] = []
    try:
        star.create()
        port = 22022  # each sshd in its own namespace: the same port on every node
        env = ssh_client(root, port, star.addrs)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for i, addr in enumerate(star.addrs):
            config = sshd_config(root, port, [addr], name=f"sshd{i}")
            subprocess.run(["/usr/sbin/sshd", "-t", "-f", str(config)], check=True)
            daemons.append(start_daemon([*star.prefix(i), "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                                        root / f"sshd{i}.log"))
        (root / "hostfile").write_text("".join(f"{a} slots=1\n" for a in star.addrs[:2]))
        nodes = SshNodes(root, port, root / "ssh_config", root / "hostfile", daemons, env, tuple(star.addrs))
        nodes.star = star
        wait_until(lambda: subprocess.run([*star.prefix(0), "pdsh", "-S", "-w", ",".join(star.addrs), "true"],
                                          env={**os.environ, **env}, capture_output=True, timeout=30).returncode == 0,
                   30, f"pdsh from node 0 to all four ({root}/sshd*.log)")
        yield nodes
    finally:
        kill_pids(session_pids(daemons))
        for d in daemons:
            stop(d)
        star.remove()
    if star.exists():
        raise AssertionError(f"network namespaces of {star.tag} still listed after ip netns del")
