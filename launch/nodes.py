"""Which nodes each attempt of a multi-node job runs on (``vit-launch run --hostfile H``).

The first attempt starts on the hostfile (less the hosts an earlier run named stragglers, with
``--exclude-slow-hosts``). Before each restart (``--max-restarts N``) a node is left out, for the rest
of this ``vit-launch run``, when

* the failed attempt's records name it dead: a rank on it left no record of its own while another
  rank's record names it among the peers that did not answer, or the hang watchdog got no stack file
  from it. Every rank that fails in Python once it has read its config writes a record, from its
  start-up on (``errors/rank-<R>.txt``: ``FailureRecord`` around all of ``pretrain.train.run``;
  ``hang/rank-<R>.txt`` when the watchdog fires; ``pretrain/resilience/lifecycle.py``), so a rank
  without one was killed with its node, not failed on its own (a crash, an exception: restarted on
  the same nodes, as torchrun's elastic agent restarts its workers);
* it does not answer: ``pdsh -w HOSTS echo`` over the same ssh the runner uses
  (``PDSH_RCMD_TYPE=ssh`` and the user's ``PDSH_SSH_ARGS_APPEND``), within ``PROBE_S``;
* (``--exclude-slow-hosts``) the run named it a straggler (``<output_dir>/stragglers.json``).

The attempt runs on the nodes left, written to ``<output_dir>/hostfile.used`` with one comment line
per node left out saying why; the same reason is one log line. It resumes elastically on the smaller
world (universal checkpoint and the data plan's remainder). No restart when fewer than
``--min-nodes`` nodes would be left or when the global batch cannot be split over the ranks left
(``train.global_batch_size`` = micro x ranks x accumulation steps): one line instead.

Ranks are numbered as DeepSpeed's launcher numbers them: the active hosts in order, each host's
slots in order (``deepspeed/launcher/launch.py``, ``global_rank_mapping``). A record counts for an
attempt when its rank started after the attempt's command was made, by the nodes' clocks (kept in
step by NTP on a cluster; one clock here).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from data_pipeline.files import write_atomic
from launch.hostfile import Host, LaunchError, parse_hostfile
from launch.runner import LaunchSpec, deepspeed_command, plan_ranks
from pretrain.checkpointing.rundir import RunDir
from pretrain.config import ConfigError, check_world_size
from pretrain.resilience.lifecycle import read_record

PROBE_S = 15  # a node that has not answered `echo` over ssh within this is not there


@dataclass
class Attempt:
    started: float  # time.time() when its command was made
    ranks: list[str]  # rank -> node name
    hosts: list[str]  # the nodes it runs on, in order


def rank_nodes(ranks: dict[str, list[int]]) -> list[str]:
    """Rank -> node for an active layout (host -> slot ids), numbered as DeepSpeed's launcher does."""
    return [host for host, slots in ranks.items() for _ in slots]


def records(layout: RunDir, since: float) -> tuple[dict[int, dict], dict[int, dict]]:
    """The failed attempt's records by rank: (errors/, hang/), those of ranks started at or after
    ``since`` (a rank of an earlier attempt on another node may end, and write, after the next
    attempt began)."""
    out = []
    for folder in (layout.errors, layout.hang):
        found = {}
        for f in sorted(folder.glob("rank-*.txt")) if folder.is_dir() else []:
            head = read_record(f)
            if head is not None and head.get("started", 0) >= since:
                found[head["rank"]] = head
        out.append(found)
    return out[0], out[1]


def named_dead(layout: RunDir, attempt: Attempt) -> dict[str, str]:
    """Node -> why, for the nodes the failed attempt's records name dead (module docstring)."""
    errors, hang = records(layout, attempt.started)
    accused: dict[int, str] = {}
    for head in errors.values():
        for r in head.get("lost") or []:
            accused.setdefault(int(r), head.get("line", ""))
    if hang:  # the watchdog fired: the ranks that wrote no stack file
        for r in range(len(attempt.ranks)):
            if r not in hang:
                accused.setdefault(r, "the hang watchdog got no stack file from it")
    dead = sorted(r for r in accused if r not in errors and r not in hang and r < len(attempt.ranks))
    out: dict[str, str] = {}
    for r in dead:
        node = attempt.ranks[r]
        if node not in out:
            ranks = [q for q in dead if attempt.ranks[q] == node]
            out[node] = (f"dead: its rank(s) {', '.join(map(str, ranks))} ended without a record of their own; "
                         f"{accused[r]}")
    return out


def probe(hosts: list[str], timeout_s: float = PROBE_S) -> dict[str, str]:
    """Node -> why, for the hosts that do not answer ``echo`` over pdsh's ssh within ``timeout_s``
    (an empty dict without pdsh: nothing to ask with)."""
    if not hosts or not shutil.which("pdsh"):
        return {}
    mark = "vitscale-node-answers"
    env = {**os.environ, "PDSH_RCMD_TYPE": "ssh"}
    cmd = ["pdsh", "-S", "-u", str(int(timeout_s)), "-w", ",".join(hosts), "echo", mark]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s + 15,
                           start_new_session=True)
        out, err = r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        out, err = (e.stdout or b"").decode(errors="replace"), "pdsh did not return"
    answered = {ln.split(":", 1)[0].strip() for ln in out.splitlines() if ln.rstrip().endswith(mark)}
    missing = {}
    for h in hosts:
        if h in answered:
            continue
        said = [ln.strip() for ln in err.splitlines() if f" {h}:" in f" {ln}" or ln.startswith(f"{h}:")]
        missing[h] = (f"does not answer over ssh within {timeout_s:g} s"
                      + (f" ({said[-1][:160]})" if said else ""))
    return missing


def slow_hosts(layout: RunDir, since: float = 0.0) -> dict[str, str]:
    """Node -> why, for the hosts ``stragglers.json`` names (written at or after ``since``)."""
    try:
        doc = json.loads(layout.stragglers.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("time", 0) < since:
        return {}
    return {h: f"slow: {doc.get('line') or 'named a straggler'} ({layout.stragglers.name})"
            for h in doc.get("hosts", [])}


def _without(spec: LaunchSpec, gone: set[str], hostfile: Path) -> LaunchSpec:
    """``spec`` on ``hostfile`` with the runner options that named the hosts now gone adjusted:
    --include/--exclude parts dropped, --num-nodes capped, a --master-addr of a gone host moved to
    the first host the adjusted spec plans ranks on (rank 0's, by its hostfile name, as ssh reaches
    it; not merely the hostfile's first, which --exclude may have taken out). Raises LaunchError
    when every host of a non-empty --include is gone: an empty --include is no filter to the runner,
    which would then start on hosts the user never chose."""
    def keep(flt: str) -> str:
        return "@".join(p for p in flt.split("@") if p and p.partition(":")[0] not in gone)

    include = keep(spec.include)
    if spec.include and not include:
        lost = list(dict.fromkeys(p.partition(":")[0] for p in spec.include.split("@") if p))
        raise LaunchError(f"--include {spec.include!r}: every host it names is lost ({', '.join(lost)}); "
                          "no restart on hosts it does not name (give --include other hosts to go on)")
    kept = parse_hostfile(hostfile)
    num = min(spec.num_nodes, len(kept)) if spec.num_nodes else spec.num_nodes
    out = dataclasses.replace(spec, hostfile=str(hostfile), include=include, exclude=keep(spec.exclude),
                              num_nodes=num)
    if spec.master_addr in gone:
        _, ranks = plan_ranks(out)
        out = dataclasses.replace(out, master_addr=next(iter(ranks)))
    return out


class NodePool:
    """The hostfile's nodes less those left out so far; ``command()`` makes each attempt's runner
    command (a callable for ``launch.supervise.Supervisor``)."""

    def __init__(self, spec: LaunchSpec, layout: RunDir, train_cfg, *, min_nodes: Optional[int] = None,
                 exclude_slow: bool = False, log: Callable[[str], None] = print):
        self.spec, self.layout, self.train = spec, layout, train_cfg
        self.min_nodes, self.exclude_slow, self.log = min_nodes, exclude_slow, log
        self.hosts: list[Host] = parse_hostfile(spec.hostfile)
        self.left_out: dict[str, str] = {}  # node -> why, in the order they were left out
        self.attempt: Optional[Attempt] = None

    def _leave_out(self, why: dict[str, str]) -> None:
        for node, reason in why.items():
            if node in self.left_out or node not in {h.name for h in self.hosts}:
                continue
            self.left_out[node] = reason
            self.log(f"leaving out {node}: {reason}")

    def review(self) -> None:
        """After a failed attempt: leave out the nodes its records name dead and those that do not
        answer now."""
        if self.attempt is None:
            return
        self._leave_out(probe([h.name for h in self.hosts if h.name not in self.left_out]))
        self._leave_out(named_dead(self.layout, self.attempt))

    def command(self) -> list[str]:
        """The next attempt's deepspeed command; writes ``hostfile.used``. Raises LaunchError (one
        line) when the nodes left cannot run the job."""
        self.review()
        if self.exclude_slow:
            self._leave_out(slow_hosts(self.layout))
        kept = [h for h in self.hosts if h.name not in self.left_out]
        if not kept:
            raise LaunchError(f"no node of {self.spec.hostfile} is left to run on")
        self.layout.root.mkdir(parents=True, exist_ok=True)
        path = self.layout.hostfile_used
        lines = [f"{h.name} slots={h.slots}\n" for h in kept]
        lines += [f"# {h.name} slots={h.slots}  left out: {self.left_out[h.name]}\n"
                  for h in self.hosts if h.name in self.left_out]
        write_atomic(path, "".join(lines))
        spec = _without(self.spec, set(self.left_out), path)
        _, ranks = plan_ranks(spec)
        world = sum(len(s) for s in ranks.values())
        where = f"{len(ranks)} node(s), {world} rank(s)"
        if self.left_out:  # the whole hostfile is pre-flight's to check
            if self.min_nodes and len(ranks) < self.min_nodes:
                raise LaunchError(f"without {', '.join(self.left_out)}: {where} left, "
                                  f"below --min-nodes {self.min_nodes}")
            try:
                check_world_size(self.train, world)
            except ConfigError as e:
                raise LaunchError(f"without {', '.join(self.left_out)}: {where} left, and {e}") from None
            self.log(f"starting on {where}: {', '.join(ranks)} (hostfile {path})")
        self.attempt = Attempt(time.time(), rank_nodes(ranks), list(ranks))
        return deepspeed_command(spec)

    def slow_named(self) -> Optional[str]:
        """A line when the running attempt named a straggler on one of its nodes (for
        ``--exclude-slow-hosts``: the supervisor then stops the job to restart without it)."""
        if self.attempt is None:
            return None
        slow = {h: why for h, why in slow_hosts(self.layout, self.attempt.started).items()
                if h in self.attempt.hosts and h not in self.left_out}
        if not slow:
            return None
        return f"{', '.join(slow)} named a straggler ({next(iter(slow.values()))})"
