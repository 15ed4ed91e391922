"""Messages between drafter sidecars: authenticated TCP links that never block the sender.

Every drafter listens on its own port (`SPECTRAIN_DRAFTER_PEERS`: one `host:port` per node, local
rank i on port + i), on the pod's own addresses (one socket per address family), and opens one
outgoing connection per peer it sends to. Each connection starts with drafter.auth's handshake
and every frame carries its MACs (the wire format is there). Sending only enqueues: a thread per
link writes the frames out, paced by one token bucket per process (the
`spec.drafter.exchange.bandwidthMBps` cap over all links). Droppable frames (samples) are dropped
when a link's queue holds `max_queue_bytes` already, so a slow or dead receiver costs bounded
memory and never stalls training; a frame kind marked `latest_only` (weights) replaces the one
still queued. A link whose peer is gone reconnects with backoff and drops what it could not deliver;
one the listener closed meanwhile (a quiet link, drafter.listener) reconnects before it writes.
The receiving side is drafter.listener. What fails is counted by cause in `Stats`
(`rejected:<cause>`).
"""

from __future__ import annotations

import collections
import functools
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spectrain_workloads.drafter.auth import Identity, Session, client_handshake

CHUNK = 1 << 20                  # payloads past this are written (and read) without a copy of them


class Rejected(Exception):
    """A received item failed a check; `cause` names the counter (drafter.checks raises it too)."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause


@dataclass
class Frame:
    kind: str
    header: dict[str, Any]
    payload: bytes | bytearray
    verify: Callable[[], bool] | None = None     # received, payload MAC not yet checked (listener)

    @functools.cached_property
    def head(self) -> bytes:
        """The header's bytes, built once: a sample frame goes to every other stage of its replica."""
        return json.dumps(self.header).encode()


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, **kw: int) -> None:
        with self.lock:
            self.counts.update(kw)

    def reject(self, cause: str) -> None:
        with self.lock:
            self.counts[f"rejected:{cause}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)

    def rejected(self) -> dict[str, int]:
        return {k.removeprefix("rejected:"): n for k, n in self.snapshot().items() if k.startswith("rejected:")}


class TokenBucket:
    """`rate` bytes/s with bursts of `burst` bytes; `take(n)` waits until n bytes may go out."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.level = burst
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int, stop: threading.Event) -> bool:
        while not stop.is_set():
            with self.lock:
                now = time.monotonic()
                self.level = min(self.burst, self.level + (now - self.t) * self.rate)
                self.t = now
                # a frame larger than the burst goes out once the bucket is full, leaving it in debt
                if self.level >= min(n, self.burst):
                    self.level -= n
                    return True
                wait = (min(n, self.burst) - self.level) / self.rate
            stop.wait(min(wait, 0.5))
        return False


def _closed_by_peer(sock: socket.socket) -> bool:
    """The listener never writes after the handshake: a readable socket is its close (or reset)."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Link:
    """Frames to the drafter of `peer_rank`, written by a thread; `send` never blocks."""

    def __init__(self, address: tuple[str, int], bucket: TokenBucket, *, max_queue_bytes: int, stats: Stats,
                 ident: Identity, rank: int, peer_rank: int, handshake_s: float) -> None:
        self.address, self.ident, self.rank, self.peer_rank = address, ident, rank, peer_rank
        self.handshake_s = handshake_s       # admission.Limits.handshake_s: the listener's deadline
        self.bucket, self.max_queue_bytes, self.stats = bucket, max_queue_bytes, stats
        self.queue: collections.deque[Frame] = collections.deque()
        self.queued_bytes = 0
        self.writing = False                 # a frame is between the queue and the socket
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.sock: socket.socket | None = None
        self.session: Session | None = None
        self.thread = threading.Thread(target=self._run, name=f"drafter-link-{peer_rank}", daemon=True)
        self.thread.start()

    @staticmethod
    def _size(frame: Frame) -> int:
        return len(frame.head) + len(frame.payload)

    def send(self, frame: Frame, *, droppable: bool = True, latest_only: bool = False) -> bool:
        size = self._size(frame)
        with self.cond:
            if latest_only:
                for i, queued in enumerate(self.queue):
                    if queued.kind == frame.kind:
                        self.queued_bytes -= self._size(queued)
                        del self.queue[i]
                        self.stats.add(dropped=1)
                        break
            if droppable and self.queued_bytes + size > self.max_queue_bytes:
                self.stats.add(dropped=1)
                return False
            self.queue.append(frame)
            self.queued_bytes += size
            self.cond.notify()
        return True

    def _connect(self) -> tuple[socket.socket, Session] | None:
        backoff = 0.05
        while not self.stop.is_set():
            s = None
            try:
                s = socket.create_connection(self.address, timeout=self.handshake_s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                session = client_handshake(s, self.ident, self.rank, self.peer_rank)
                s.settimeout(10.0)      # a receiver that stops reading for this long is dropped
                return s, session
            except OSError:             # AuthError too: a foreign listener gets nothing
                if s is not None:
                    s.close()
                self.stats.add(connect_failed=1)
                self._drop_queued()     # nobody to deliver to: what is queued is stale by the next try
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
        return None

    def _drop_queued(self) -> None:
        with self.cond:
            if self.queue:
                self.stats.add(dropped=len(self.queue))
            self.queue.clear()
            self.queued_bytes = 0

    def _write(self, frame: Frame) -> None:
        assert self.sock is not None and self.session is not None
        head, tag_p = self.session.seal(frame.kind, frame.head, bytes(frame.payload))
        if len(frame.payload) < CHUNK:
            self.sock.sendall(head + frame.payload + tag_p)
        else:                          # no copy of a large payload
            self.sock.sendall(head)
            self.sock.sendall(frame.payload)
            self.sock.sendall(tag_p)

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.cond:
                while not self.queue and not self.stop.is_set():
                    self.cond.wait(0.5)
                if self.stop.is_set():
                    break
                frame = self.queue.popleft()
                size = self._size(frame)
                self.queued_bytes -= size
                self.writing = True
            if self.sock is not None and _closed_by_peer(self.sock):
                self.sock.close()
                self.sock = self.session = None
            if self.sock is None:
                got = self._connect()
                if got is None:
                    break
                self.sock, self.session = got
            if not self.bucket.take(size, self.stop):
                break
            try:
                self._write(frame)
                self.stats.add(sent=1, sent_bytes=size)
            except OSError:
                self.stats.add(dropped=1)
                self.sock.close()
                self.sock = self.session = None
            with self.cond:
                self.writing = False
                self.cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything queued was written (or dropped); False after `timeout_s`."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.queue and not self.writing, timeout_s)

    def close(self) -> None:
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        self.thread.join(timeout=2.0)
        if self.sock is not None:
            self.sock.close()
