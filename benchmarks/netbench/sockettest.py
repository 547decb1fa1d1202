"""Measure a link with one TCP stream: ``server`` counts what arrives, ``client`` sends for a while.

    python -m benchmarks.netbench.sockettest server HOST PORT      # prints received bits/s
    python -m benchmarks.netbench.sockettest client HOST PORT SECONDS

The receiver's figure is the goodput the training processes can expect (TCP payload bits/s).
"""

from __future__ import annotations

import socket
import sys
import time

CHUNK = 1 << 16


def serve(host: str, port: int) -> float:
    """Accept one connection, read until it closes; return received payload bits per second."""
    with socket.create_server((host, port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            received, started = 0, None
            while data := connection.recv(CHUNK):
                if started is None:
                    started = time.perf_counter()
                received += len(data)
            elapsed = time.perf_counter() - (started or time.perf_counter())
    return received * 8 / elapsed if elapsed > 0 else 0.0


def send(host: str, port: int, seconds: float) -> None:
    """Stream zeros to ``host:port`` for ``seconds``."""
    payload = bytes(CHUNK)
    with socket.create_connection((host, port), timeout=30) as connection:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            connection.sendall(payload)


if __name__ == "__main__":
    role, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":
        print(f"{serve(host, port):.0f}", flush=True)
    else:
        send(host, port, float(sys.argv[4]))
