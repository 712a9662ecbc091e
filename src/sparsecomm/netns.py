"""A shaped network for real bandwidth tests: one Linux network namespace per worker, each joined
to a bridge (in a hub namespace of its own) by a veth pair rate-limited with ``tc tbf`` in both
directions — like workers on a switch with ports of the given rate. Needs root and iproute2;
`ShapedNetwork.available` says whether this machine allows it. Addresses are private and live
only inside the namespaces created here.

The token bucket holds `BURST_S` of line time (at least `MIN_BURST_BYTES`): a real port sends
every byte at its rate, and a larger bucket lets any message that fits through at the veth's own
speed once the link has idled, in a fraction of its wire time — which flatters small payloads
(compressed gradients) over large ones (dense all_reduces).
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import uuid
from types import TracebackType

from sparsecomm.errors import SparseCommError

INTERFACE = "scnet"
_CLONE_NEWNET = 0x40000000
RATES = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
BURST_S, MIN_BURST_BYTES = 256e-6, 16 * 1024
"""the token bucket: this much line time, and never less than this many bytes (tbf must hold a few
packets: the smaller the bucket, the further a message of many buckets falls behind its wire time)"""


def bits_per_second(rate: str) -> float:
    """'1gbit' → 1e9; a bare number is bits per second."""
    number, scale = rate.lower(), 1.0
    for suffix, factor in RATES.items():
        if number.endswith(suffix):
            number, scale = number[: -len(suffix)], factor
    try:
        value = float(number) * scale
    except ValueError:
        raise SparseCommError(f"cannot read link rate {rate!r}; use e.g. 100mbit or 1gbit") from None
    if not math.isfinite(value) or value <= 0:
        raise SparseCommError(f"link rate must be a finite number > 0, got {rate!r}")
    return value


def link_burst(rate: str) -> str:
    """The token bucket for a link of ``rate``, in bytes as ``tc`` reads them (`BURST_S`)."""
    return str(max(MIN_BURST_BYTES, round(bits_per_second(rate) / 8 * BURST_S)))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class ShapedNetwork:
    """``with ShapedNetwork(workers=4, rate="1gbit") as net:`` — ``net.namespaces[r]`` for rank r;
    with several ranks per namespace, each namespace is a node (`ranks_on_nodes`)."""

    def __init__(self, workers: int, rate: str = "1gbit", burst: str | None = None, latency: str = "50ms") -> None:
        self.workers, self.rate, self.latency = workers, rate, latency
        self.burst = burst if burst is not None else link_burst(rate)
        tag = uuid.uuid4().hex[:6]
        self.hub = f"sc-{tag}-hub"
        self.namespaces = [f"sc-{tag}-w{r}" for r in range(workers)]

    @staticmethod
    def available() -> tuple[bool, str]:
        """(True, "") if namespaces and tbf can be created here, else (False, why)."""
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return False, "iproute2 (ip, tc) is not installed"
        if os.geteuid() != 0:
            return False, "shaping a link needs root"
        probe = f"sc-probe-{uuid.uuid4().hex[:6]}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return False, f"'ip netns add' failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return True, ""

    def __enter__(self) -> ShapedNetwork:
        ok, why = self.available()
        if not ok:
            raise SparseCommError(f"cannot shape a network here: {why}")
        try:
            self._build()
        except subprocess.CalledProcessError as err:
            self.__exit__(None, None, None)
            raise SparseCommError(f"building the shaped network failed: {err.stderr or err}") from None
        return self

    def _build(self) -> None:
        hub = ["ip", "netns", "exec", self.hub]
        _ip("netns", "add", self.hub)
        subprocess.run([*hub, "ip", "link", "add", "br0", "type", "bridge"], check=True, capture_output=True)
        subprocess.run([*hub, "ip", "link", "set", "br0", "up"], check=True, capture_output=True)
        for rank, namespace in enumerate(self.namespaces):
            inside = ["ip", "netns", "exec", namespace]
            port = f"p{rank}"
            _ip("netns", "add", namespace)
            _ip("link", "add", INTERFACE, "netns", namespace, "type", "veth", "peer", "name", port,
                "netns", self.hub)
            subprocess.run([*inside, "ip", "addr", "add", f"{self.address(rank)}/16", "dev", INTERFACE], check=True,
                           capture_output=True)
            for command in (["ip", "link", "set", INTERFACE, "up"], ["ip", "link", "set", "lo", "up"]):
                subprocess.run([*inside, *command], check=True, capture_output=True)
            subprocess.run([*hub, "ip", "link", "set", port, "master", "br0"], check=True, capture_output=True)
            subprocess.run([*hub, "ip", "link", "set", port, "up"], check=True, capture_output=True)
            shape = ["tc", "qdisc", "add", "dev", "{}", "root", "tbf", "rate", self.rate, "burst", self.burst,
                     "latency", self.latency]
            subprocess.run([*inside, *[a.replace("{}", INTERFACE) for a in shape]], check=True, capture_output=True)
            subprocess.run([*hub, *[a.replace("{}", port) for a in shape]], check=True, capture_output=True)

    @staticmethod
    def address(index: int) -> str:
        """The IPv4 address of namespace ``index`` on the link (what a rendezvous endpoint names)."""
        return f"10.213.{index // 250}.{index % 250 + 1}"

    def ranks_on_nodes(self, ranks: int) -> list[str]:
        """The namespace of each of ``ranks`` ranks laid out on the network's namespaces as nodes
        (rank r on node r // (ranks / nodes)): ranks of one node reach each other over its
        loopback, the other nodes over the shaped link."""
        if ranks % self.workers:
            raise SparseCommError(f"{ranks} ranks do not fill {self.workers} nodes of equal size")
        return [self.namespaces[rank // (ranks // self.workers)] for rank in range(ranks)]

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for namespace in [*self.namespaces, self.hub]:
            _ip("netns", "del", namespace, check=False)


def bytes_sent_here() -> int | None:
    """Bytes this process's network namespace has sent onto the shaped link so far (its interface's
    own counter, headers included); None outside a shaped network."""
    with open("/proc/self/net/dev") as table:  # the table of the reading process's namespace
        for line in table:
            name, _, counters = line.partition(":")
            if name.strip() == INTERFACE:
                return int(counters.split()[8])
    return None


def enter_namespace(name: str) -> None:
    """Move the calling process (before it opens sockets or starts threads that do) into ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
