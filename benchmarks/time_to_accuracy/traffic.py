"""Bytes this process has sent over TCP, from the kernel's per-socket counters (Linux ``TCP_INFO``).

Gloo moves every collective over TCP sockets it keeps open for the process group's life, so the
sum of ``tcpi_bytes_sent - tcpi_bytes_retrans + tcpi_notsent_bytes`` over the process's TCP
sockets is the payload it handed to the kernel (TCP/IP headers excluded, retransmissions counted
once, bytes still waiting in the send buffer for a slow receiver included), whatever hook or
averager produced it: the same counter for dense DDP, torch's hooks and ours, and on loopback as in a namespace
(where an interface's ``tx_bytes`` would mix both ranks). Kernels before 4.19 have no
``bytes_sent``; there ``bytes_acked`` is used.
"""

from __future__ import annotations

import os
import socket
import struct

TCP_INFO_LENGTH = 232
BYTES_ACKED_AT = 120
NOTSENT_BYTES_AT = 144
BYTES_SENT_AT, BYTES_RETRANS_AT = 200, 208


def _socket_bytes(fd: int) -> int | None:
    """Payload bytes sent by the TCP socket ``fd``; None for anything else."""
    try:
        duplicate = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    with duplicate:
        if duplicate.type != socket.SOCK_STREAM or duplicate.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            info = duplicate.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LENGTH)
        except OSError:
            return None
    if len(info) >= BYTES_RETRANS_AT + 8:
        sent, retransmitted = struct.unpack_from("=QQ", info, BYTES_SENT_AT)
        return sent - retransmitted + struct.unpack_from("=I", info, NOTSENT_BYTES_AT)[0]
    return struct.unpack_from("=Q", info, BYTES_ACKED_AT)[0] if len(info) >= BYTES_ACKED_AT + 8 else None


class TcpCounter:
    """Running total of the payload bytes this process sent over TCP since it was created.

    Sockets are found anew at every :meth:`read` (``/proc/self/fd``); a socket closed between two
    reads keeps the count of its last read.
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._start = self._total()

    def _total(self) -> int:
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:"):
                sent = _socket_bytes(int(name))
                if sent is not None:
                    self._last[target] = sent
        return sum(self._last.values())

    def read(self) -> int:
        """Bytes sent since this counter was created."""
        return self._total() - self._start
