"""An outsider without the fleet's key, for tests/integration/test_fleet_starvation.py: a process of
its own (it competes for the CPU as a pod would, not for the test's interpreter).

    python -m tests.integration.fleet_attacker MODE N PORT [PORT ...]

MODE hold: N connections to every port, opened from the job's start (before the drafters listen:
refused connects are retried), never sending a byte, each reopened as soon as the drafter closes it
(at most HOLD_RATE a second: a held connection is back within a millisecond, and the attacker
does not take a core of the machine both jobs share).
MODE churn: N connects per second to every port, each closed at once.
On SIGTERM it prints `{"connects": C}` (the connections it opened) and exits.
"""

from __future__ import annotations

import json
import selectors
import signal
import socket
import sys
import threading
import time

RETRY_S = 0.005          # a port not listening yet: the attacker keeps knocking
HOLD_RATE = 1000         # reopened connections per second, at most


def _open(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=1.0)
    except OSError:
        return None


def hold(n: int, ports: list[int], stop: threading.Event, count: list[int]) -> None:
    sel = selectors.DefaultSelector()
    missing = [p for p in ports for _ in range(n)]
    t0 = time.monotonic()
    while not stop.is_set():
        still = []
        for port in missing:
            ahead = (count[0] - n * len(ports)) / HOLD_RATE - (time.monotonic() - t0)
            if ahead > 0:
                stop.wait(ahead)
            s = _open(port)
            if s is None:
                still.append(port)
                continue
            count[0] += 1
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, port)
        missing = still
        for key, _ in sel.select(RETRY_S if missing else 0.5):
            held: socket.socket = key.fileobj      # type: ignore[assignment]
            try:
                gone = held.recv(1 << 10) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                sel.unregister(held)
                held.close()
                missing.append(key.data)


def churn(rate: int, ports: list[int], stop: threading.Event, count: list[int]) -> None:
    t0, k = time.monotonic(), 0
    while not stop.is_set():
        k += 1
        for port in ports:
            s = _open(port)
            if s is not None:
                count[0] += 1
                s.close()
        stop.wait(max(t0 + k / rate - time.monotonic(), 0.0))


def main(argv: list[str]) -> None:
    mode, n, ports = argv[0], int(argv[1]), [int(p) for p in argv[2:]]
    stop, count = threading.Event(), [0]
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    (hold if mode == "hold" else churn)(n, ports, stop, count)
    print(json.dumps({"connects": count[0]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
