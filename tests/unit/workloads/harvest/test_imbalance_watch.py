"""Imbalance deadlines (imbalance_watch.py): the SIGALRM watch and the thread fallback keep the
same contract: fire once after an armed deadline, never for a disarmed or superseded one."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest

from spectrain_workloads.harvest.imbalance_watch import AlarmWatch, ThreadWatch, Watch, make_watch
from spectrain_workloads.harvest.instrument import Instrument, InstrumentOptions
from tests.waiting import wait_for

# pytest-timeout's default method uses SIGALRM itself; the thread method leaves it to the watch
pytestmark = [pytest.mark.unit, pytest.mark.timeout(120, method="thread")]

MS = 1_000_000


class _Fired:
    def __init__(self) -> None:
        self.times: list[int] = []
        self.event = threading.Event()

    def __call__(self) -> None:
        self.times.append(time.monotonic_ns())
        self.event.set()

    def wait(self) -> None:
        assert self.event.wait(5), "the watch never fired"
        self.event.clear()


@pytest.fixture(params=[AlarmWatch, ThreadWatch])
def kind(request: pytest.FixtureRequest) -> Callable[[Callable[[], None]], Watch]:
    if request.param is AlarmWatch and signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None):
        pytest.fail("SIGALRM is taken in the test process; AlarmWatch cannot be tested here")
    return request.param  # type: ignore[no-any-return]


def test_fires_once_after_the_deadline(kind: Callable[[Callable[[], None]], Watch]) -> None:
    fired = _Fired()
    w = kind(fired)
    try:
        deadline = time.monotonic_ns() + 3 * MS
        w.arm(deadline)
        fired.wait()
        assert fired.times[0] >= deadline
    finally:
        w.stop()
    assert len(fired.times) == 1


def test_disarmed_and_superseded_deadlines_do_not_fire(kind: Callable[[Callable[[], None]], Watch]) -> None:
    fired = _Fired()
    w = kind(fired)
    try:
        w.arm(time.monotonic_ns() + 2 * MS)
        w.disarm()                                   # the wait ended in time
        w.arm(time.monotonic_ns() + 1 * MS)
        later = time.monotonic_ns() + 30 * MS
        w.arm(later)                                 # re-armed for the next sync point before it passed
        fired.wait()
        assert fired.times == [fired.times[0]] and fired.times[0] >= later
    finally:
        w.stop()


def test_alarm_watch_gives_sigalrm_back_and_falls_back_off_the_main_thread() -> None:
    before = signal.getsignal(signal.SIGALRM)
    w = make_watch(lambda: None)
    assert isinstance(w, AlarmWatch)
    assert isinstance(make_watch(lambda: None), ThreadWatch)     # SIGALRM is taken now: the fallback
    w.stop()
    assert signal.getsignal(signal.SIGALRM) == before
    assert signal.set_wakeup_fd(-1) == -1

    got: list[Watch] = []
    t = threading.Thread(target=lambda: got.append(make_watch(lambda: None)))
    t.start()
    t.join()
    assert isinstance(got[0], ThreadWatch)
    got[0].stop()


def test_a_blocked_main_thread_gets_an_imbalance_window() -> None:
    """The Instrument's sync point with the alarm: the training (main) thread blocks past the
    expected end + imbalance_min, the Imbalance window opens during the block and closes after."""
    recs: list[dict[str, object]] = []
    ins = Instrument(rank=0, stage=0, opts=InstrumentOptions(cost_path="", imbalance_min_ns=2 * MS), sink=recs.append)
    try:
        released = threading.Event()
        ins.sync_begin()
        # block the main thread until the window is open (a peer's lateness); the alarm interrupts
        # this wait, which Python resumes
        threading.Thread(target=lambda: (wait_for(lambda: ins._imbalance is not None, 5, 0.001,
                                                  "the Imbalance window"), released.set())).start()
        assert released.wait(5)
        ins.sync_end()
        ins.end_step()
    finally:
        ins.close()
    assert [r["kind"] for r in recs] == ["Imbalance"]
    assert recs[0]["predicted_ns"] == 0 and int(recs[0]["actual_ns"]) > 0  # type: ignore[call-overload]
