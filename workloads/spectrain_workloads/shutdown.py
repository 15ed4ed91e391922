"""SIGTERM handling for a target rank: save a checkpoint and exit within the grace period.

A Python signal handler only runs when the main thread executes bytecode, and a rank whose peers
already stopped can sit inside a collective forever. So SIGTERM is blocked in every thread
(`block_sigterm()`, called before torch starts its threads) and received by a dedicated thread
with `sigwait`. That thread sets `requested`; the training loop checks it at each step boundary,
saves and exits. If the loop has not done so within half the grace period (it is blocked on a
peer), the thread saves the state of the last completed step itself and exits the process.
Saving from the side thread is consistent because weights and optimizer state only change in the
optimizer step, which runs under `state_lock`, and the RNG/loader snapshot is taken at the
boundary under the same lock.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from spectrain_api.names import EXIT_TERMINATED


def block_sigterm() -> None:
    """Block SIGTERM in the calling thread (and so in every thread it starts later)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


class Terminator:
    def __init__(self, grace_s: float, emergency_save: Callable[[], None]) -> None:
        self.grace_s = grace_s
        self.requested = threading.Event()
        self.done = threading.Event()          # the training loop saved and is exiting
        self.state_lock = threading.Lock()
        self._emergency_save = emergency_save
        self._thread = threading.Thread(target=self._run, name="spectrain-sigterm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        signal.sigwait({signal.SIGTERM})
        t0 = time.monotonic()
        self.requested.set()
        print("[spectrain-target] SIGTERM: saving a checkpoint at the next step boundary", file=sys.stderr,
              flush=True)
        if self.done.wait(self.grace_s / 2):
            return
        left = self.grace_s - (time.monotonic() - t0) - 1.0
        if not self.state_lock.acquire(timeout=max(0.1, left / 2)):
            print("[spectrain-target] SIGTERM: the optimizer step did not finish in time; exiting unsaved",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_TERMINATED)
        if self.done.is_set():
            return
        try:
            self._emergency_save()
            print("[spectrain-target] SIGTERM: blocked on a peer; saved the last completed step", file=sys.stderr,
                  flush=True)
        finally:
            os._exit(EXIT_TERMINATED)
