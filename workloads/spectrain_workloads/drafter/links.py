"""Messages between drafter sidecars: TCP links that never block the sender.

Every drafter listens on its own port (`SPECTRAIN_DRAFTER_PEERS`: one `host:port` per node, local
rank i on port + i) and opens one outgoing connection per peer it sends to. A frame is

    [json length: u32][payload length: u64][json header][payload bytes]

with `kind` in the header. Sending only enqueues: a thread per link writes the frames out, paced
by one token bucket per process (the `spec.drafter.exchange.bandwidthMBps` cap over all links).
Droppable frames (samples) are dropped when a link's queue holds `max_queue_bytes` already, so a
slow or dead receiver costs bounded memory and never stalls training; a frame kind marked
`latest_only` (weights) replaces the one still queued. A link whose peer is gone reconnects with
backoff and drops what it could not deliver. Received frames go to one handler callback, called
on the link's reader thread.
"""

from __future__ import annotations

import collections
import functools
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_HEAD = struct.Struct(">IQ")
MAX_FRAME_BYTES = 1 << 31


@dataclass
class Frame:
    kind: str
    header: dict[str, Any]
    payload: bytes

    @functools.cached_property
    def encoded(self) -> bytes:
        """The wire bytes, built once: a sample frame goes to every other stage of its replica."""
        head = json.dumps({"kind": self.kind, **self.header}).encode()
        return _HEAD.pack(len(head), len(self.payload)) + head + self.payload

    def encode(self) -> bytes:
        return self.encoded


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> Frame | None:
    """The next frame, or None when the peer closed the connection."""
    raw = _recv_exact(sock, _HEAD.size)
    if raw is None:
        return None
    n_head, n_payload = _HEAD.unpack(raw)
    if n_head > 1 << 20 or n_payload > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame too large ({n_head} + {n_payload} bytes): not a drafter peer")
    head = _recv_exact(sock, n_head)
    payload = _recv_exact(sock, n_payload) if n_payload else b""
    if head is None or payload is None:
        return None
    meta = json.loads(head)
    return Frame(kind=meta.pop("kind"), header=meta, payload=payload)


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


class Link:
    """Frames to one peer, written by a thread; `send` never blocks."""

    def __init__(self, address: tuple[str, int], bucket: TokenBucket, *, max_queue_bytes: int,
                 stats: Stats) -> None:
        self.address = address
        self.bucket, self.max_queue_bytes, self.stats = bucket, max_queue_bytes, stats
        self.queue: collections.deque[tuple[Frame, bytes]] = collections.deque()
        self.queued_bytes = 0
        self.writing = False                 # a frame is between the queue and the socket
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name=f"drafter-link-{address[1]}", daemon=True)
        self.thread.start()

    def send(self, frame: Frame, *, droppable: bool = True, latest_only: bool = False) -> bool:
        data = frame.encode()
        with self.cond:
            if latest_only:
                for i, (queued, qdata) in enumerate(self.queue):
                    if queued.kind == frame.kind:
                        self.queued_bytes -= len(qdata)
                        del self.queue[i]
                        self.stats.add(dropped=1)
                        break
            if droppable and self.queued_bytes + len(data) > self.max_queue_bytes:
                self.stats.add(dropped=1)
                return False
            self.queue.append((frame, data))
            self.queued_bytes += len(data)
            self.cond.notify()
        return True

    def _connect(self) -> socket.socket | None:
        backoff = 0.05
        while not self.stop.is_set():
            try:
                s = socket.create_connection(self.address, timeout=2.0)
                s.settimeout(10.0)      # a receiver that stops reading for this long is dropped
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s
            except OSError:
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

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.cond:
                while not self.queue and not self.stop.is_set():
                    self.cond.wait(0.5)
                if self.stop.is_set():
                    break
                frame, data = self.queue.popleft()
                self.queued_bytes -= len(data)
                self.writing = True
            if self.sock is None:
                self.sock = self._connect()
                if self.sock is None:
                    break
            if not self.bucket.take(len(data), self.stop):
                break
            try:
                self.sock.sendall(data)
                self.stats.add(sent=1, sent_bytes=len(data))
            except OSError:
                self.stats.add(dropped=1)
                self.sock.close()
                self.sock = None
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


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, **kw: int) -> None:
        with self.lock:
            self.counts.update(kw)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


class Server:
    """Accepts peers' connections on `bind`; each frame goes to `handler(frame)`."""

    def __init__(self, bind: tuple[str, int], handler: Callable[[Frame], None], stats: Stats) -> None:
        self.handler, self.stats = handler, stats
        self.sock = socket.create_server(bind, reuse_port=False)
        self.sock.settimeout(0.5)
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, name="drafter-server", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), name="drafter-reader", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while not self.stop.is_set():
                frame = read_frame(conn)
                if frame is None:
                    return
                self.stats.add(received=1, received_bytes=len(frame.payload))
                self.handler(frame)
        except (OSError, ConnectionError, ValueError):
            return          # a broken or foreign peer: its frames stop here, nothing else does
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.thread.join(timeout=2.0)
