"""Two emulated nodes on one machine: network namespaces joined by a veth pair, shaped by tbf.

    with TwoNodeLink(rate="1gbit") as link:       # creates, shapes, measures
        link.nodes, link.master_addr, link.measured_bps

Namespaces ``lgcbench0``/``lgcbench1`` hold ``lgcveth0`` (10.231.0.1) and ``lgcveth1``
(10.231.0.2); traffic only ever flows between these two addresses. Each end's egress is a
``tbf`` qdisc at ``rate`` with a burst of about 2 ms of line rate (32kb at 100mbit, 256kb at
1gbit); ``rate=None`` leaves the link unshaped. Everything is deleted on exit, on exceptions and
on SIGTERM/SIGHUP (turned into ``SystemExit`` while the link exists); leftovers of an earlier
killed run with the same names are removed before creation.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import FrameType, TracebackType

from benchmarks.netbench.launch import REPO, Node
from lightning_gc.perfmodel import parse_rate

NAMESPACES = ("lgcbench0", "lgcbench1")
INTERFACES = ("lgcveth0", "lgcveth1")
ADDRESSES = ("10.231.0.1", "10.231.0.2")
BURST_SECONDS = 0.002
BURST_QUANTUM = 32 * 1024
SOCKET_TEST_PORT = 29450


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def burst_bytes(bits_per_second: float) -> int:
    """About 2 ms of line rate, rounded up to 32 KiB (32kb at 100mbit, 256kb at 1gbit in tc's units)."""
    return -(-int(bits_per_second * BURST_SECONDS / 8) // BURST_QUANTUM) * BURST_QUANTUM


class TwoNodeLink:
    """Context manager owning the namespaces, the veth pair and its qdiscs (see module docstring)."""

    def __init__(self, rate: str | None, cores: tuple[str, str] = ("0", "1"), socket_seconds: float = 2.0) -> None:
        self.rate = rate
        self.cores = cores
        self.socket_seconds = socket_seconds
        self.measured_bps = 0.0
        self._previous: dict[int, object] = {}

    @property
    def master_addr(self) -> str:
        return ADDRESSES[0]

    @property
    def nodes(self) -> tuple[Node, Node]:
        """Node k runs in namespace k, pinned to ``cores[k]`` (a ``taskset`` CPU list such as ``"2-3"``)."""
        return tuple(  # type: ignore[return-value]
            Node(ifname=INTERFACES[k], prefix=("ip", "netns", "exec", NAMESPACES[k], "taskset", "-c", self.cores[k]))
            for k in range(2)
        )

    def __enter__(self) -> TwoNodeLink:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._previous[signum] = signal.signal(signum, self._exit_on_signal)
        try:
            self.teardown()
            self._create()
            self.measured_bps = self.measure()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.teardown()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    @staticmethod
    def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def _create(self) -> None:
        for ns in NAMESPACES:
            _ip("netns", "add", ns)
        _ip("link", "add", INTERFACES[0], "type", "veth", "peer", "name", INTERFACES[1])
        for ns, dev, addr in zip(NAMESPACES, INTERFACES, ADDRESSES):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                burst = burst_bytes(parse_rate(self.rate))
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                     "burst", str(burst), "latency", "100ms"],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip

    def measure(self) -> float:
        """Goodput node 0 -> node 1 in bits/s, one TCP stream for ``socket_seconds``."""
        module = [sys.executable, "-m", "benchmarks.netbench.sockettest"]
        server = subprocess.Popen(
            ["ip", "netns", "exec", NAMESPACES[1], *module, "server", ADDRESSES[1], str(SOCKET_TEST_PORT)],
            stdout=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            server.stdout.readline()  # "ready"
            subprocess.run(
                ["ip", "netns", "exec", NAMESPACES[0], *module, "client", ADDRESSES[1], str(SOCKET_TEST_PORT),
                 str(self.socket_seconds)],
                check=True, timeout=self.socket_seconds + 60, cwd=REPO,
            )  # fmt: skip
            return float(server.stdout.readline())
        finally:
            if server.poll() is None:
                server.kill()
            server.wait()

    @staticmethod
    def teardown() -> None:
        """Delete our namespaces (their veth ends go with them); silent when absent."""
        for ns in NAMESPACES:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", INTERFACES[0], check=False)
        time.sleep(0.1)
