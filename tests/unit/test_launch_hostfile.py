"""Hostfiles: our strict parser against DeepSpeed's own, line-numbered errors, and which ranks a
runner option set selects (plain logic, no processes)."""
import pytest
from deepspeed.launcher.runner import _parse_hostfile, apply_num_nodes_and_gpus, parse_inclusion_exclusion

from launch.hostfile import LaunchError, active_ranks, parse_hostfile, world_size

GOOD = """# two nodes of the cluster
worker-0 slots=8
worker-1   slots=8   # trailing comment

worker-2 slots=4
"""


def _write(tmp_path, text, name="hostfile"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_parses_what_deepspeed_parses(tmp_path):
    hosts = parse_hostfile(_write(tmp_path, GOOD))
    assert [(h.name, h.slots, h.line) for h in hosts] == [("worker-0", 8, 2), ("worker-1", 8, 3), ("worker-2", 4, 5)]
    # the runner reads the same file to the same pool (its parser is the reference)
    assert dict(_parse_hostfile(GOOD.splitlines(True))) == {h.name: h.slots for h in hosts}


@pytest.mark.parametrize("text, needle", [
    ("worker-0 slots=8\nworker-1 slot=8\n", ":2: expected 'HOST slots=N'"),
    ("worker-0 slots=8\nworker-1 slots=0\n", ":2: host 'worker-1' has slots=0"),
    ("worker-0 slots=8\n\nworker-0 slots=4\n", ":3: duplicate host 'worker-0' (first on line 1)"),
    ("worker-0 slots=eight\n", ":1: slots must be a whole number, got 'eight'"),
    ("worker-0\n", ":1: expected 'HOST slots=N'"),
    ("worker-0 slots=8 gpu=a100\n", ":1: expected 'HOST slots=N'"),
    ("# only comments\n\n", ": no hosts"),
])
def test_bad_hostfile_names_the_line(tmp_path, text, needle):
    p = _write(tmp_path, text)
    with pytest.raises(LaunchError) as e:
        parse_hostfile(p)
    msg = str(e.value)
    assert msg.startswith(str(p)) and needle in msg and "\n" not in msg


def test_missing_hostfile(tmp_path):
    with pytest.raises(LaunchError, match="hostfile not found"):
        parse_hostfile(tmp_path / "nope")


def _runner_pool(hosts, include="", exclude="", num_nodes=-1, num_gpus=-1):
    """The deepspeed runner's own resolution of the same options (runner.main's two steps)."""
    pool = {h.name: h.slots for h in hosts}
    active = parse_inclusion_exclusion(pool, include, exclude)
    return [(h, list(s)) for h, s in apply_num_nodes_and_gpus(active, num_nodes, num_gpus).items()]


@pytest.mark.parametrize("kw, world", [
    ({}, 20),
    ({"num_nodes": 2}, 16),
    ({"gpus_per_node": 2}, 6),
    ({"num_nodes": 2, "gpus_per_node": 4}, 8),
    ({"include": "worker-0@worker-2:0,2"}, 10),
    ({"exclude": "worker-1@worker-0:7"}, 11),
    ({"include": "worker-2@worker-0"}, 12),  # the runner keeps hostfile order: rank 0 is on worker-0
    ({"include": "worker-0:1@worker-0@worker-2:3@worker-2:1"}, 3),  # a slot list wins over a bare name
    ({"exclude": "worker-0:1@worker-0"}, 19),
])
def test_rank_layout_matches_the_runner(tmp_path, kw, world):
    hosts = parse_hostfile(_write(tmp_path, GOOD))
    ranks = active_ranks(hosts, **kw)
    assert world_size(ranks) == world
    ref = _runner_pool(hosts, kw.get("include", ""), kw.get("exclude", ""), kw.get("num_nodes", -1),
                       kw.get("gpus_per_node", -1))
    assert [(h, list(s)) for h, s in ranks.items()] == ref  # hosts in the runner's order: rank numbering


@pytest.mark.parametrize("kw, needle", [
    ({"num_nodes": 4}, "--num-nodes 4: hostfile lists only 3 host(s)"),
    ({"gpus_per_node": 6}, "hostfile:5: worker-2 has only slots=4"),
    ({"include": "worker-9"}, "host 'worker-9' is not in the hostfile"),
    ({"include": "worker-0:8"}, "worker-0 has slots 0-7, not 8"),
    ({"include": "worker-0", "num_nodes": 1}, "cannot be combined"),
])
def test_impossible_layouts_say_what_to_change(tmp_path, kw, needle):
    hosts = parse_hostfile(_write(tmp_path, GOOD))
    with pytest.raises(LaunchError) as e:
        active_ranks(hosts, **kw)
    assert needle in str(e.value)


def test_no_hostfile_is_one_local_node():
    assert world_size(active_ranks(None, gpus_per_node=4)) == 4
    with pytest.raises(LaunchError, match="--num-nodes 2 needs --hostfile"):
        active_ranks(None, num_nodes=2, gpus_per_node=4)


def test_node_env_file_adds_the_store_location_to_what_the_runner_reads(tmp_path, monkeypatch):
    """Other nodes' ranks get what pdsh forwards and the lines of DS_ENV_FILE: the file vit-launch
    hands the runner keeps the user's lines and adds where the S3 store is, never its secrets."""
    import stat

    from launch.runner import node_env_file

    user = tmp_path / "user_env"
    user.write_text("PATH=/opt/bin\nAWS_DEFAULT_REGION=eu-west-1\n")
    env = {"DS_ENV_FILE": str(user), "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_SHARED_CREDENTIALS_FILE": "/shared/aws/credentials", "AWS_ACCESS_KEY_ID": "AKIA",
           "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "token"}
    path, added = node_env_file(tmp_path / "run" / "deepspeed_env", env)
    assert added == ["AWS_ENDPOINT_URL", "AWS_SHARED_CREDENTIALS_FILE"]  # the user's region line wins
    assert path.read_text() == ("PATH=/opt/bin\nAWS_DEFAULT_REGION=eu-west-1\nAWS_ENDPOINT_URL=http://127.0.0.1:9000\n"
                                "AWS_SHARED_CREDENTIALS_FILE=/shared/aws/credentials\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert node_env_file(tmp_path / "none", {"PATH": "/bin", "AWS_ACCESS_KEY_ID": "AKIA"}) is None  # nothing to add
    assert not (tmp_path / "none").exists()

    # no DS_ENV_FILE: the runner's own two files, ~/.deepspeed_env and ./.deepspeed_env
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=1\n")
    (cwd / ".deepspeed_env").write_text("B=2\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    path, added = node_env_file(tmp_path / "run2" / "env", {"AWS_ENDPOINT_URL_S3": "http://minio:9000"})
    assert added == ["AWS_ENDPOINT_URL_S3"] and path.read_text() == "A=1\nB=2\nAWS_ENDPOINT_URL_S3=http://minio:9000\n"


def test_a_restart_leaves_out_the_nodes_whose_ranks_left_no_record(tmp_path):
    """Records as the ranks write them (``report_failure``, the watchdog's header): a node is dead
    when one of its ranks left no record while another names it; a rank that failed on its own
    (its own record) keeps its node; records of an earlier attempt's ranks do not count."""
    import json
    import time

    from launch.nodes import Attempt, named_dead, rank_nodes
    from pretrain.checkpointing.rundir import RunDir
    from pretrain.resilience.lifecycle import STARTED, report_failure

    layout = RunDir.of(tmp_path / "run")
    # 3 nodes x 2 slots, numbered as DeepSpeed's launcher numbers them
    ranks = rank_nodes({"a": [0, 1], "b": [0, 1], "c": [0, 1]})
    assert ranks == ["a", "a", "b", "b", "c", "c"]
    attempt = Attempt(STARTED - 1, ranks, ["a", "b", "c"])  # this process is one of its ranks

    def record(rank, lost=None, started=None, folder="errors"):
        head = {"rank": rank, "host": ranks[rank], "time": time.time(), "started": started or STARTED,
                "line": f"rank {rank} on {ranks[rank]}: no answer within 5 s from rank 4 on c"}
        if lost is not None:
            head["lost"] = lost
        (layout.root / folder).mkdir(parents=True, exist_ok=True)
        (layout.root / folder / f"rank-{rank}.txt").write_text(json.dumps(head) + "\nTraceback ...\n")

    assert named_dead(layout, attempt) == {}  # no records: nothing to go by
    for r in (0, 1, 2, 3):
        record(r, lost=[4, 5])
    dead = named_dead(layout, attempt)
    assert list(dead) == ["c"] and dead["c"].startswith("dead: its rank(s) 4, 5 ended without a record of their own; "
                                                       "rank 0 on a: no answer within 5 s from rank 4 on c")
    # rank 5 failed on its own (an exception: report_failure's record, no peer error): node c keeps
    # only rank 4 named, and is still dead (one rank killed with its node is enough)
    assert report_failure(ValueError("bad batch"), ranks, layout.errors, 5) is None  # its own: the caller raises
    assert named_dead(layout, attempt)["c"].startswith("dead: its rank(s) 4 ended without")
    record(4)  # rank 4 wrote too: both failed, neither was killed
    assert named_dead(layout, attempt) == {}
    # an earlier attempt's rank 4 (started before this attempt) ending late does not vouch for node c
    record(4, started=attempt.started - 60)
    assert "c" in named_dead(layout, attempt)
    # the hang watchdog fired on ranks 0-3 (stack files), none from 4 and 5: c is dead
    for f in layout.errors.glob("*.txt"):
        f.unlink()
    for r in (0, 1, 2, 3):
        record(r, folder="hang")
    assert named_dead(layout, attempt)["c"].endswith("the hang watchdog got no stack file from it")


def test_a_restart_moves_the_master_to_a_node_that_runs_ranks_and_keeps_include(tmp_path):
    """The nodes left after a node is left out: a --master-addr on it moves to the first host the
    runner will start ranks on (not an --exclude'd one: the ranks could not meet), and an --include
    whose hosts are all gone is refused (an empty --include lets the runner take the whole hostfile)."""
    import json
    import time

    from deepspeed.launcher.runner import parse_args as runner_parse_args

    from launch.nodes import NodePool
    from launch.runner import LaunchSpec
    from pretrain.checkpointing.rundir import RunDir
    from pretrain.config.schema import TrainConfig

    hostfile = _write(tmp_path, "a slots=2\nb slots=2\nc slots=2\n")
    train = TrainConfig(global_batch_size=8, micro_batch_size=1)

    def restart(name, **kw):  # an earlier run named `b` a straggler (--exclude-slow-hosts); no probe before
        layout = RunDir.of(tmp_path / name)  # the first start (a later one asks every host over pdsh)
        layout.root.mkdir(parents=True)
        layout.stragglers.write_text(json.dumps({"time": time.time(), "hosts": ["b"], "line": "b is slow"}))
        return NodePool(LaunchSpec("x.yaml", hostfile=str(hostfile), master_addr="b", **kw), layout, train,
                        exclude_slow=True, log=lambda line: None)

    pool = restart("exclude", exclude="a")
    args = runner_parse_args(pool.command()[1:])
    assert (args.master_addr, args.exclude, pool.attempt.hosts) == ("c", "a", ["c"])

    pool = restart("include", include="b:0,1")
    with pytest.raises(LaunchError) as e:
        pool.command()
    assert str(e.value) == ("--include 'b:0,1': every host it names is lost (b); no restart on hosts it does not "
                            "name (give --include other hosts to go on)")

    pool = restart("include2", include="c@b")  # one host of --include left: rank 0 on it
    args = runner_parse_args(pool.command()[1:])
    assert (args.master_addr, args.include, pool.attempt.hosts) == ("c", "c", ["c"])


@pytest.mark.parametrize("text, kw, remote", [
    ("worker-0 slots=8\nworker-1 slots=8\n", {"num_nodes": 1, "gpus_per_node": 8}, True),
    ("worker-0 slots=8\nworker-1 slots=8\n", {"include": "worker-1"}, True),  # a restart left one node
    ("worker-0 slots=8\nworker-1 slots=8\n", {"num_nodes": 2, "gpus_per_node": 8}, True),
    ("localhost slots=2\n", {"gpus_per_node": 2}, False),
    ("127.0.0.1 slots=2\n127.0.0.2 slots=2\n", {"num_nodes": 1, "gpus_per_node": 2}, False),
])
def test_one_host_of_a_hostfile_starts_there_not_here(tmp_path, text, kw, remote):
    """DeepSpeed's runner takes its multi-node path (pdsh to each host) only with two or more
    active hosts or ``--force_multi``; else it starts the ranks on the machine running it. A job on
    one host of a hostfile (``--num-nodes 1``, a restart that kept one node) must start on that host."""
    from deepspeed.launcher.runner import parse_args as runner_parse_args

    from launch.runner import LaunchSpec, deepspeed_command

    spec = LaunchSpec(config="c.yaml", hostfile=str(_write(tmp_path, text)), **kw)
    args = runner_parse_args(deepspeed_command(spec, executable="deepspeed")[1:])
    pool = parse_inclusion_exclusion(_parse_hostfile(open(args.hostfile).read().splitlines()), args.include,
                                     args.exclude)
    active = apply_num_nodes_and_gpus(pool, args.num_nodes, args.num_gpus)
    assert (args.force_multi or len(active) > 1) == remote, (args, active)
