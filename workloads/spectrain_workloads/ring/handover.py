"""Handing a ring from its target to readers: the Unix socket at the ring path, and the copy at close.

The ring path is a Unix socket (SOCK_SEQPACKET) through which a daemon thread of the target hands
the memfd out (mapping.py): one message per connection, the 4096-byte header built from the
target's own values (never from the shared memory) with the fd as SCM_RIGHTS. The connection
stays open until the target closes or dies.

A producer never replaces the path in place: it binds `.<name>.<pid>.tmp`, chmods it 0600, then
renames it over the path, so a reader sees either the previous ring or a complete new one. The
previous ring, if its target still answers, is marked SUPERSEDED and its sleepers are woken; a
dead one is found by readers through the path's inode. On close, the producer renames a copy of
its ring (state CLOSED) over its socket: a reader that comes later (a drafter restart, a test)
still gets everything published, from a regular file it reads into private memory.
"""

from __future__ import annotations

import os
import selectors
import socket
import stat
import sys
import threading
import time
from collections import deque
from pathlib import Path

from spectrain_workloads.ring import layout as L
from spectrain_workloads.ring.errors import RingError
from spectrain_workloads.ring.mapping import (
    FIX_RECREATE,
    STATIC_RANGES,
    Inode,
    Mapping,
    create_memory,
    map_received,
    read_copy,
)

SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the terminating NUL
MAX_CONNECTIONS = 16  # open hand-over connections the target keeps; the oldest is closed beyond
HANDOVER_TIMEOUT_S = 5.0  # connect -> header + fd; the target's thread answers in microseconds
_GENERATION_MAX = 0xFFFFFFFF  # window ids keep the generation's low 32 bits


class _Address:
    """A socket address for `path` that fits sun_path: the path itself, or, for a long directory,
    /proc/self/fd/<dir fd>/<name>, which the kernel resolves to the same directory entry (an
    abstract address would not cross containers: they share a volume, not a namespace)."""

    def __init__(self, path: Path) -> None:
        self._dir_fd = -1
        self.addr = str(path)
        if len(os.fsencode(self.addr)) > SUN_PATH_MAX:
            try:
                self._dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise RingError(f"ring directory {path.parent} cannot be opened ({exc.strerror})") from exc
            self.addr = f"/proc/self/fd/{self._dir_fd}/{path.name}"
            if len(os.fsencode(self.addr)) > SUN_PATH_MAX or not os.path.isdir(f"/proc/self/fd/{self._dir_fd}"):
                self.close()
                raise RingError(f"ring path {path} is {len(os.fsencode(str(path)))} bytes, longer than a Unix "
                                f"socket address may be ({SUN_PATH_MAX} bytes), and /proc/self/fd cannot shorten "
                                f"it: use a shorter SPECTRAIN_RING_DIR")

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> str:
        return self.addr

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Server:
    """Hands the memfd to whoever connects to the ring path (daemon thread). It never reads what
    a client sends; a client that speaks or hangs up is dropped. Nothing here can raise into the
    target: a failed accept or send only loses that one connection."""

    def __init__(self, listener: socket.socket, memfd: int, hello: bytes, name: str) -> None:
        self._listener, self._memfd, self._hello = listener, memfd, hello
        self._conns: deque[socket.socket] = deque()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._stop_r, selectors.EVENT_READ)
        self.inode: Inode = (0, 0)
        self._thread = threading.Thread(target=self._run, name=f"spectrain-ring-server-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.fileobj == self._stop_r:
                    return
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._drop(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        try:
            conn.setblocking(False)  # one small message into an empty socket buffer: never waits
            socket.send_fds(conn, [self._hello], [self._memfd])
        except OSError:
            conn.close()
            return
        self._conns.append(conn)
        self._sel.register(conn, selectors.EVENT_READ)
        if len(self._conns) > MAX_CONNECTIONS:
            self._drop(self._conns[0])

    def _drop(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        self._conns.remove(conn)
        conn.close()

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join()
        for conn in self._conns:
            conn.close()
        self._sel.close()
        self._listener.close()
        os.close(self._stop_r)
        os.close(self._stop_w)


class Ring:
    """The producer's side of one ring: the memfd, its mapping and the socket serving it."""

    def __init__(self, path: Path, memfd: int, mapping: Mapping, server: _Server, hello: bytes) -> None:
        self.path, self.memfd, self.mapping, self.server, self.hello = path, memfd, mapping, server, hello

    def close(self) -> None:
        """Stop serving; leave a copy of the (closed) ring at the path if the path is still ours."""
        self.server.close()
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self.server.inode:
                _write_snapshot(self.path, self.mapping, self.hello)
        except OSError:
            pass  # the directory went away or is full: nothing left to hand to late readers
        self.mapping.close()
        os.close(self.memfd)


def _write_snapshot(path: Path, m: Mapping, hello: bytes) -> None:
    """Copy the ring into a regular file at `path` (tmp + rename over the socket). The static
    header is rewritten from the target's own values: the shared copy may have been scribbled on."""
    tmp = _tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(m.mm)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
        finally:
            view.release()
        for lo, hi in STATIC_RANGES:
            os.pwrite(fd, hello[lo:hi], lo)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _clean_stale_temps(path: Path) -> None:
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def _bounded_generation(value: int) -> int:
    """A generation read from something another process could have written: used only if sane."""
    return value if 0 < value < _GENERATION_MAX else 0


def _previous(path: Path) -> tuple[int, Mapping | None]:
    """Generation of the ring now at `path` (0 if none, foreign or unknown) and, when its target
    still serves it, a mapping of it (to mark it SUPERSEDED)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0, None
    if stat.S_ISSOCK(st.st_mode):
        try:
            m = _receive(path, (st.st_dev, st.st_ino), timeout_s=HANDOVER_TIMEOUT_S)
        except (OSError, RingError):
            # Its target died without closing: its generation died with it. The wall clock in
            # seconds (< 2**32 until 2106) stays above every generation reached by +1 steps.
            return int(time.time()), None
        return m.generation, m
    if not stat.S_ISREG(st.st_mode):
        return 0, None
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return 0, None
    if len(head) < 24 or head[:8] != L.MAGIC:
        return 0, None
    return _bounded_generation(int.from_bytes(head[L.H_GENERATION:L.H_GENERATION + 8], sys.byteorder)), None


def create_ring(path: Path, layout: L.RingLayout, rank: int) -> Ring:
    """Create a fresh READY ring (generation = previous + 1), serve it at `path`, return it."""
    if not path.parent.is_dir():
        raise RingError(f"ring directory {path.parent} does not exist: mount the memory-backed ring volume "
                        f"there (SPECTRAIN_RING_DIR) or create the directory")
    geo = L.Geometry.of(layout)
    old_generation, old = _previous(path)
    generation = old_generation + 1 if old_generation < _GENERATION_MAX else 1
    _clean_stale_temps(path)
    memfd, m, hello = create_memory(path, geo, generation, rank)
    try:
        server = _serve(path, memfd, hello)
    except BaseException:
        os.close(memfd)
        raise
    if old is not None:
        old.mark_superseded()
        old.close()
    m.inode = server.inode
    return Ring(path, memfd, m, server, hello)


def _serve(path: Path, memfd: int, hello: bytes) -> _Server:
    tmp = _tmp_name(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        with _Address(tmp) as addr:
            listener.bind(addr)
        try:
            os.chmod(tmp, 0o600)  # bind honours the umask; the ring is private either way
            st = os.lstat(tmp)
            listener.listen(MAX_CONNECTIONS)
            server = _Server(listener, memfd, hello, path.name)
            server.inode = (st.st_dev, st.st_ino)
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except BaseException:
        listener.close()
        raise
    return server


def _receive(path: Path, inode: Inode, timeout_s: float) -> Mapping:
    """Connect to the target serving `path`, receive header + memfd, map it. OSError when nobody
    listens (ECONNREFUSED: its target is gone) or the path went away."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout_s)
        with _Address(path) as addr:
            sock.connect(addr)
        try:
            msg, fds, _, _ = socket.recv_fds(sock, L.HEADER_BYTES, 1)
        except TimeoutError:
            raise RingError(f"ring {path}: the target accepted but sent no ring within {timeout_s:g}s: it is "
                            f"stuck; restart it") from None
        if not fds:
            raise RingError(f"ring {path}: the socket's server sent no ring ({len(msg)} bytes): it is not a "
                            f"spectrain target; {FIX_RECREATE}")
        try:
            m = map_received(path, msg, fds[0], inode, sock)
        finally:
            for extra in fds:
                os.close(extra)
        sock.setblocking(True)
        return m
    except BaseException:
        sock.close()
        raise


def open_ring(path: Path, timeout_s: float) -> Mapping:
    """Map the ring at `path`, waiting up to `timeout_s` for a target to serve it; RingError otherwise."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    refused = False
    while True:
        try:
            st = os.lstat(path)
            inode = (st.st_dev, st.st_ino)
            if stat.S_ISSOCK(st.st_mode):
                return _receive(path, inode, HANDOVER_TIMEOUT_S)
            if stat.S_ISREG(st.st_mode):
                return read_copy(path, inode)
            raise RingError(f"ring {path} is neither a target's socket nor a ring file: {FIX_RECREATE}")
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            refused = isinstance(exc, ConnectionRefusedError)
            if time.monotonic() >= deadline:
                why = ("is a socket nobody serves: its target died" if refused else "does not exist")
                raise RingError(f"ring {path} {why} (waited {timeout_s:g}s): the target on this rank creates "
                                f"it; check it runs and that both containers mount the same "
                                f"SPECTRAIN_RING_DIR") from None
            time.sleep(0.01)  # a new ring appears by an atomic rename; poll the name until the deadline
        except PermissionError as exc:
            try:
                st = os.stat(path)
                who = f"mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}"
            except OSError:
                who = "mode unknown"
            raise RingError(f"ring {path} cannot be opened read-write ({who}; this process runs as uid "
                            f"{os.getuid()}): run the drafter as the target's user (same runAsUser)") from exc
        except OSError as exc:
            raise RingError(f"ring {path} cannot be opened ({exc.strerror}): {FIX_RECREATE}") from exc
