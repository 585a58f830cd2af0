"""Hostfiles in DeepSpeed's (MPI-style) format, and which ranks a launch will start.

    # comment
    worker-0 slots=8
    worker-1 slots=8

DeepSpeed's runner (``deepspeed/launcher/runner.py``, ``_parse_hostfile``) matches each line with
``^(\\S+)\\s+slots=(\\d+)`` and raises a ``ValueError`` that quotes the whole file. We check the same
grammar more strictly (nothing after ``slots=N``, N > 0, no duplicate host) *before* the job
starts, and name the line, so a typo costs one line of stderr instead of a multi-node launch.

The rank layout mirrors the runner's ``apply_num_nodes_and_gpus`` and
``parse_inclusion_exclusion``: ``--num_nodes`` keeps the first N hosts; ``--num_gpus`` uses slots
``[0, G)`` on each; ``--include``/``--exclude`` take ``NAME[:SLOT[,SLOT...]][@NAME...]``, and the
hosts kept stay in hostfile order whatever order ``--include`` names them in (``parse_resource_filter``).
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.errors import ConfigError

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")


class LaunchError(ConfigError):
    """A user mistake in launch arguments or a hostfile; the message is one line."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int  # 1-based line in the hostfile (0: not from a file)


def parse_hostfile(path: str | Path) -> list[Host]:
    """Hosts in file order. Errors name ``path:line``."""
    path = Path(path)
    if not path.is_file():
        raise LaunchError(f"{path}: hostfile not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:  # a binary file, or another encoding: DeepSpeed's runner would fail on it too
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise LaunchError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x}); a hostfile is lines of "
                          "'HOST slots=N'") from None
    hosts: dict[str, Host] = {}
    for no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise LaunchError(f"{path}:{no}: expected 'HOST slots=N' (e.g. 'worker-0 slots=8'), got {raw.strip()!r}")
        host, slots = m["host"], m["slots"]
        if not slots.isdigit():
            raise LaunchError(f"{path}:{no}: slots must be a whole number, got {slots!r}")
        if int(slots) == 0:
            raise LaunchError(f"{path}:{no}: host {host!r} has slots=0; give it at least 1 slot or remove the line")
        if host in hosts:
            raise LaunchError(f"{path}:{no}: duplicate host {host!r} (first on line {hosts[host].line}); "
                              "list each host once with its total slots")
        hosts[host] = Host(host, int(slots), no)
    if not hosts:
        raise LaunchError(f"{path}: no hosts; add lines like 'worker-0 slots=8'")
    return list(hosts.values())


def local_gpu_count() -> int:
    """GPUs this machine offers, without touching CUDA (pre-flight must not claim a device):
    ``CUDA_VISIBLE_DEVICES`` when set, else the ``/dev/nvidiaN`` device files, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return sum(1 for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d))
    except OSError:
        return 0


def _parse_filter(spec: str, flag: str, pool: "OrderedDict[str, list[int]]") -> dict[str, Optional[list[int]]]:
    """``a@b:0,2`` -> {"a": None (all slots), "b": [0, 2]}; unknown hosts / slots are errors. As the
    runner's ``parse_node_config_list``: a host named twice gets the union of its slot lists, and a
    bare name means all slots only when no part lists slots of that host (``a:1@a`` is slot 1)."""
    out: dict[str, Optional[list[int]]] = {}
    for part in spec.split("@"):
        name, colon, slots = part.partition(":")
        if name not in pool:
            raise LaunchError(f"{flag} {spec!r}: host {name!r} is not in the hostfile ({', '.join(pool)})")
        if not colon:
            out.setdefault(name, None)
            continue
        try:
            ids = [int(s) for s in slots.split(",")]
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: slots must be numbers, e.g. {name}:0,1") from None
        bad = [i for i in ids if i not in pool[name]]
        if bad:
            raise LaunchError(f"{flag} {spec!r}: {name} has slots 0-{len(pool[name]) - 1}, not {bad[0]}")
        out[name] = sorted(set((out.get(name) or []) + ids))
    return out


def active_ranks(hosts: Optional[list[Host]], *, num_nodes: Optional[int] = None,
                 gpus_per_node: Optional[int] = None, include: str = "", exclude: str = "",
                 hostfile: str = "hostfile") -> "OrderedDict[str, list[int]]":
    """Host -> slot ids the runner will start a rank on (world size = total slot ids).

    ``hosts=None`` means no hostfile: one local node with ``gpus_per_node`` ranks (the caller
    resolves the default). Errors say which flag to change."""
    if (include or exclude) and (num_nodes or gpus_per_node):
        raise LaunchError("--include/--exclude cannot be combined with --num-nodes/--gpus-per-node "
                          "(the deepspeed runner refuses it); use one or the other")
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive")
    if hosts is None:
        if num_nodes and num_nodes > 1:
            raise LaunchError(f"--num-nodes {num_nodes} needs --hostfile listing at least {num_nodes} hosts")
        if include or exclude:
            raise LaunchError("--include/--exclude need --hostfile")
        return OrderedDict(localhost=list(range(gpus_per_node or 1)))

    pool = OrderedDict((h.name, list(range(h.slots))) for h in hosts)
    if include:
        sel = _parse_filter(include, "--include", pool)  # hostfile order, as the runner keeps it
        pool = OrderedDict((h, s if sel[h] is None else sel[h]) for h, s in pool.items() if h in sel)
    elif exclude:
        sel = _parse_filter(exclude, "--exclude", pool)
        for h, ids in sel.items():
            pool[h] = [] if ids is None else [s for s in pool[h] if s not in ids]
        pool = OrderedDict((h, s) for h, s in pool.items() if s)
    if num_nodes:
        if num_nodes > len(pool):
            raise LaunchError(f"--num-nodes {num_nodes}: {hostfile} lists only {len(pool)} host(s)")
        pool = OrderedDict(list(pool.items())[:num_nodes])
    if gpus_per_node:
        short = [h for h in hosts if h.name in pool and h.slots < gpus_per_node]
        if short:
            h = short[0]
            raise LaunchError(f"--gpus-per-node {gpus_per_node}: {hostfile}:{h.line}: {h.name} has only "
                              f"slots={h.slots}; lower --gpus-per-node or fix the hostfile")
        pool = OrderedDict((h, list(range(gpus_per_node))) for h in pool)
    if not pool:
        raise LaunchError(f"--exclude {exclude!r} leaves no slots to run on")
    return pool


def world_size(ranks: dict[str, list[int]]) -> int:
    return sum(len(s) for s in ranks.values())
