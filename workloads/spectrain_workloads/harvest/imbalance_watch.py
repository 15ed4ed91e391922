"""Imbalance deadlines: fire once when a rank is still blocked at a sync point past a deadline.

The Instrument arms a deadline when the training thread reaches a sync point (the expected end of
the transfers it waits for + imbalance_min) and disarms it when the wait is over; if the deadline
passes first, `fire()` opens the Imbalance window while the rank is still blocked (in gloo's or
DDP's C++ wait, which has no safe timeout: on gloo a timed-out wait closes the connection).

Two ways to watch, same contract (`arm(deadline_ns)`, `disarm()`, `stop()`; `fire()` runs under
the watch's lock, so a `disarm()` that returns has either prevented it or seen it happen):
- `AlarmWatch` (used when it can be: on the main thread of a process whose SIGALRM is free): the
  deadline is an interval timer (setitimer, ITIMER_REAL). Arming and disarming are one syscall each
  on the caller's thread and wake no thread at all; only when the deadline passes does the signal's
  C-level handler write to a wakeup fd and a thread blocked on it opens the window: a thread woken
  at every sync point competes with training for the cores (docs/benchmarks.md, target). SIGALRM
  is blocked in the other threads that exist when it is set up (the trainer calls `block_alarm_in_new_threads` before creating any, gloo's and its own, and
  `unblock_alarm` after), so only the main thread is interrupted, and its blocking calls restart
  (C++ waits) or are retried (Python, PEP 475). Without that, AlarmWatch still works; the signal
  then lands on any thread that does not block it.
- `ThreadWatch`: a thread sleeping until the deadline (any thread, any platform).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Watch(Protocol):
    def arm(self, deadline_ns: int) -> None: ...
    def disarm(self) -> None: ...
    def stop(self) -> None: ...


def block_alarm_in_new_threads() -> None:
    """Block SIGALRM in the calling (main) thread, so that the threads created from now on inherit
    the block. Call it before any thread starts, and `unblock_alarm()` once they all have."""
    if _alarm_possible():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})


def unblock_alarm() -> None:
    """Let the calling (main) thread take SIGALRM again (the other threads keep it blocked)."""
    if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def _alarm_possible() -> bool:
    return (hasattr(signal, "setitimer") and hasattr(signal, "pthread_sigmask")
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None))


def make_watch(fire: Callable[[], None]) -> Watch:
    if _alarm_possible():
        try:
            return AlarmWatch(fire)
        except (OSError, ValueError):
            pass    # SIGALRM or the wakeup fd taken after all: fall back
    return ThreadWatch(fire)


class AlarmWatch:
    """Deadline on SIGALRM (see the module docstring)."""

    def __init__(self, fire: Callable[[], None]) -> None:
        self._fire = fire
        self._lock = threading.Lock()
        self._deadline: int | None = None
        self._stopped = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        # the Python-level handler does nothing: the C-level one writes the signal number to the fd
        self._old_handler = signal.signal(signal.SIGALRM, _ignore)
        try:
            self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        except ValueError:
            signal.signal(signal.SIGALRM, self._old_handler)
            raise
        if self._old_fd != -1:      # somebody else's wakeup fd: give it back and fall back
            signal.set_wakeup_fd(self._old_fd)
            signal.signal(signal.SIGALRM, self._old_handler)
            raise ValueError("the signal wakeup fd is in use")
        self._thread = threading.Thread(target=self._run, name="spectrain-imbalance-alarm", daemon=True)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})   # the reader thread inherits it
        self._thread.start()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def arm(self, deadline_ns: int) -> None:
        with self._lock:
            self._deadline = deadline_ns
        signal.setitimer(signal.ITIMER_REAL, max(deadline_ns - time.monotonic_ns(), 1000) / 1e9)

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None
        signal.setitimer(signal.ITIMER_REAL, 0)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        with self._lock:
            self._stopped = True
            self._deadline = None
        os.write(self._w, b"\0")
        self._thread.join(timeout=5)
        signal.set_wakeup_fd(self._old_fd)
        signal.signal(signal.SIGALRM, self._old_handler)
        os.close(self._r)
        os.close(self._w)

    def _run(self) -> None:
        alarm = int(signal.SIGALRM)
        while True:
            data = os.read(self._r, 64)     # signal numbers, one byte each (other signals too)
            with self._lock:
                if self._stopped:
                    return
                # A stale alarm (disarmed, or re-armed for a later deadline meanwhile) is ignored.
                if alarm in data and self._deadline is not None and time.monotonic_ns() >= self._deadline:
                    self._deadline = None
                    self._fire()


def _ignore(signum: int, frame: object) -> None:
    return None


class ThreadWatch(threading.Thread):
    """The fallback: a thread sleeps until the armed deadline.

    On 2 busy cores a wake-up of this thread can cost the training processes more than the Python it
    runs (the woken thread takes a CPU and the GIL from a training thread; see the module docstring).
    So arm() only wakes it when it sleeps past the new deadline (idle, or on a later deadline),
    disarm() never does (a thread asleep on a stale deadline wakes there, finds the deadline moved
    on or gone, and sleeps again), and the waiting is C-level (a SimpleQueue get with a timeout, a plain lock): little Python runs per wake-up."""

    def __init__(self, fire: Callable[[], None]) -> None:
        super().__init__(name="spectrain-imbalance-watchdog", daemon=True)
        self._fire = fire
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._deadline: int | None = None
        self._sleeping_until: int | None = None     # the deadline this thread sleeps on (None: idle)
        self._stopped = False
        self.start()

    def arm(self, deadline_ns: int) -> None:
        with self._lock:
            self._deadline = deadline_ns
            wake = self._sleeping_until is None or self._sleeping_until > deadline_ns
            if wake:
                self._sleeping_until = deadline_ns      # one wake-up is enough until it sleeps again
        if wake:
            self._wake.put(None)

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.put(None)
        self.join(timeout=5)

    def run(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                deadline = self._deadline
                left = None if deadline is None else deadline - time.monotonic_ns()
                if left is not None and left <= 0:
                    self._deadline = None
                    # Open the window while holding the lock: disarm() cannot slip between the
                    # deadline check and the window, so sync_end() always sees and closes it.
                    self._fire()
                    continue
                self._sleeping_until = deadline
            try:
                self._wake.get(timeout=None if left is None else left / 1e9)
            except queue.Empty:
                pass
