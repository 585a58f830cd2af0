"""Two network namespaces joined by a veth pair: two "nodes" on one machine whose link the test
shapes (``tc ... tbf``) and cuts (``ip link set ... down``) with the real kernel.

    node A (namespace vsA-<pid>)  veth va<pid>  169.254.77.1/30 <-> 169.254.77.2/30  veth vb<pid>  (vsB-<pid>) node B

Each namespace also has its own ``lo`` up. Nothing else is routed: a command prefixed with
``Link.prefix(side)`` (``ip netns exec <ns>``) reaches the other node only over the veth pair. Names
carry the creating process's PID, so a leftover of a killed session never collides with a new one;
``remove`` deletes both namespaces (which destroys the veth pair and its qdiscs with them) and is safe
to call twice.

``Star`` makes N such nodes on one switch instead: a namespace per node, each joined by its own veth
pair to a bridge in a switch namespace, so one node's link can be cut while the others keep talking::

    node i (vsN<i>-<tag>)  vsnode 169.254.78.<i+1>/24 <-> vp<i> (vsS-<tag>: bridge br0)

Every node's end is called ``vsnode`` inside its namespace (the same ``GLOO_SOCKET_IFNAME`` for all).

Needs root and iproute2 (``ip``, ``tc``); the kernel here has ``tbf`` but not ``netem``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

ADDR = {"a": "169.254.77.1", "b": "169.254.77.2"}
PREFIX = 30

_LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); s.settimeout(float(sys.argv[2]))
print(s.getsockname()[1], flush=True)
try:
    s.accept()
except OSError:
    pass
"""
_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3]))"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
    return r


def missing() -> str | None:
    """Why the namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"needs {tool} (Debian: iproute2)"
    return None


@dataclass
class Link:
    """Two namespaces and the veth pair between them (``a``/``b`` name the two ends)."""
    tag: str

    @property
    def ns(self) -> dict[str, str]:
        return {"a": f"vsA-{self.tag}", "b": f"vsB-{self.tag}"}

    @property
    def dev(self) -> dict[str, str]:  # interface names: at most 15 characters
        return {"a": f"va{self.tag}"[:15], "b": f"vb{self.tag}"[:15]}

    def create(self) -> "Link":
        self.remove()  # a leftover of the same tag (a PID reused after a killed session)
        for side in "ab":
            ip("netns", "add", self.ns[side])
        ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        for side in "ab":
            ip("link", "set", self.dev[side], "netns", self.ns[side])
            self.run(side, "ip", "addr", "add", f"{ADDR[side]}/{PREFIX}", "dev", self.dev[side])
            self.run(side, "ip", "link", "set", "lo", "up")
            self.run(side, "ip", "link", "set", self.dev[side], "up")
        return self

    def remove(self) -> None:
        """Delete both namespaces (the veth pair and its qdiscs go with them), and the pair itself
        should one end still be in this namespace (a create that failed half-way)."""
        for side in "ab":
            ip("netns", "del", self.ns[side], check=False)
        ip("link", "del", self.dev["a"], check=False)

    def exists(self) -> bool:
        listed = ip("netns", "list", check=False).stdout.split()
        return any(n in listed for n in self.ns.values())

    # --------------------------------------------------------------------------------- commands
    def prefix(self, side: str) -> list[str]:
        """Prepended to a command line to run it inside node ``side``'s namespace."""
        return ["ip", "netns", "exec", self.ns[side]]

    def run(self, side: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.prefix(side), *cmd], capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"[{self.ns[side]}] {' '.join(cmd)} -> {r.returncode}: {r.stderr.strip()}")
        return r

    def reachable(self, timeout_s: float = 2.0) -> bool:
        """A TCP connection from A to a one-shot listener on B's address: True when it is
        accepted within ``timeout_s`` (no ``ping`` here; this is what the job's sockets do)."""
        listener = subprocess.Popen(
            [*self.prefix("b"), sys.executable, "-c", _LISTEN, ADDR["b"], str(timeout_s + 2)],
            stdout=subprocess.PIPE, text=True)
        try:
            port = listener.stdout.readline().strip()
            r = self.run("a", sys.executable, "-c", _CONNECT, ADDR["b"], port, str(timeout_s), check=False)
            return r.returncode == 0
        finally:
            listener.kill()
            listener.wait()

    # ------------------------------------------------------------------------ shaping and cutting
    def shape(self, rate: str, burst: str = "32kbit", latency: str = "400ms") -> None:
        """A token-bucket filter on both ends: each direction carries at most ``rate``."""
        for side in "ab":
            self.run(side, "tc", "qdisc", "replace", "dev", self.dev[side], "root", "tbf", "rate", rate,
                     "burst", burst, "latency", latency)

    def qdisc(self, side: str) -> str:
        return self.run(side, "tc", "qdisc", "show", "dev", self.dev[side]).stdout

    def bytes_sent(self, side: str) -> int:
        """Bytes the kernel sent on ``side``'s veth end since it was made (``ip -s link``)."""
        out = self.run(side, "ip", "-j", "-s", "link", "show", self.dev[side]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def state(self, side: str) -> str:
        """``UP`` or ``DOWN`` of ``side``'s veth end (``DOWN`` also when the peer end is down: no carrier)."""
        out = self.run(side, "ip", "-j", "link", "show", self.dev[side]).stdout
        return json.loads(out)[0]["operstate"]

    def set_link(self, side: str, up: bool) -> None:
        """``ip link set <veth> down|up`` inside ``side``: down cuts the pair (the peer loses its
        carrier), up restores it with its address (the connected route comes back)."""
        self.run(side, "ip", "link", "set", self.dev[side], "up" if up else "down")


STAR_NET, STAR_DEV = "169.254.78", "vsnode"


@dataclass
class Star:
    """``n`` node namespaces on a bridge in a switch namespace (module docstring)."""
    tag: str
    n: int = 4

    @property
    def switch(self) -> str:
        return f"vsS-{self.tag}"

    def ns(self, i: int) -> str:
        return f"vsN{i}-{self.tag}"

    def addr(self, i: int) -> str:
        return f"{STAR_NET}.{i + 1}"

    @property
    def addrs(self) -> list[str]:
        return [self.addr(i) for i in range(self.n)]

    def create(self) -> "Star":
        self.remove()
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            ip("netns", "add", self.ns(i))
            # both ends made in their namespaces: no name of ours ever exists in this one
            ip("link", "add", STAR_DEV, "netns", self.ns(i), "type", "veth",
               "peer", "name", f"vp{i}", "netns", self.switch)
            ip("-n", self.switch, "link", "set", f"vp{i}", "master", "br0")
            ip("-n", self.switch, "link", "set", f"vp{i}", "up")
            ip("-n", self.ns(i), "addr", "add", f"{self.addr(i)}/24", "dev", STAR_DEV)
            ip("-n", self.ns(i), "link", "set", "lo", "up")
            ip("-n", self.ns(i), "link", "set", STAR_DEV, "up")
        return self

    def remove(self) -> None:
        """Delete every namespace (their veth pairs and the bridge go with them); safe to call twice."""
        for name in [self.ns(i) for i in range(self.n)] + [self.switch]:
            ip("netns", "del", name, check=False)

    def exists(self) -> bool:
        listed = ip("netns", "list", check=False).stdout.split()
        return any(n in listed for n in [self.ns(i) for i in range(self.n)] + [self.switch])

    def prefix(self, i: int) -> list[str]:
        """Prepended to a command line to run it on node ``i``."""
        return ["ip", "netns", "exec", self.ns(i)]

    def set_link(self, i: int, up: bool) -> None:
        """Node ``i``'s port on the switch down (the node is cut off from every other) or up again."""
        ip("-n", self.switch, "link", "set", f"vp{i}", "up" if up else "down")

    def state(self, i: int) -> str:
        """``UP``, or ``DOWN`` when its port is down (no carrier), of node ``i``'s own end."""
        out = ip("-n", self.ns(i), "-j", "link", "show", STAR_DEV).stdout
        return json.loads(out)[0]["operstate"]
