"""drafter.allreduce between real processes on loopback (forked after torch is imported): the
work-weighted average exact against a reference, zero-work members not diluting, a member
SIGKILLed or stalled mid-round (the survivors' round ends within the bound), a restarted member
rejoining with the newest version, and no combined work lost."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from spectrain_workloads.drafter.allreduce import Combiner, start_store

pytestmark = pytest.mark.integration

CTX = mp.get_context("fork")
SHAPES = {"fc.weight": (6, 4), "fc.bias": (6,), "norm": (3,)}
TIMEOUT_S, RENDEZVOUS_S = 4.0, 1.0
BOUND_S = 2 * TIMEOUT_S + RENDEZVOUS_S      # Combiner.round's documented bound
REPLY_S = 60.0


def params_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _store(conn: Any, port: int = 0) -> None:
    store = start_store("127.0.0.1", port)
    conn.send(store.port)
    conn.recv()


def _member(rank: int, world: int, port: int, conn: Any) -> None:
    torch.set_num_threads(1)
    c = Combiner(rank, world, ("127.0.0.1", port), TIMEOUT_S, rendezvous_s=RENDEZVOUS_S)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            c.close()
            return
        if msg[0] == "join":
            c.join()
            conn.send("joined")
            continue
        if msg[0] == "resume":
            c.resume(*msg[1:])
            continue
        _, params, work_s = msg
        t0 = time.monotonic()
        r = c.round(params, work_s)
        conn.send({"t": time.monotonic() - t0, "version": c.version, "members": c.size,
                   "work_total_s": c.work_total_s, "result": None if r is None else
                   {"params": r.params, "credited_s": r.credited_s, "work_s": r.work_s, "round_id": r.round_id}})


class Fleet:
    def __init__(self, n: int, world: int | None = None) -> None:
        self.n = n if world is None else world
        self.host_conn, child = CTX.Pipe()
        self.host = CTX.Process(target=_store, args=(child,), daemon=True)
        self.host.start()
        self.port = self.host_conn.recv()
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        for r in range(n):
            self.start(r)
        self.started = n

    def start(self, rank: int) -> None:
        a, b = CTX.Pipe()
        p = CTX.Process(target=_member, args=(rank, self.n, self.port, b), daemon=True)
        p.start()
        self.procs[rank], self.conns[rank] = p, a

    def send(self, rank: int, params: dict[str, torch.Tensor], work_s: float) -> None:
        self.conns[rank].send(("round", params, work_s))

    def reply(self, rank: int) -> Any:
        assert self.conns[rank].poll(REPLY_S), f"member {rank} did not answer in {REPLY_S} s"
        return self.conns[rank].recv()

    def round(self, inputs: dict[int, tuple[dict[str, torch.Tensor], float]]) -> dict[int, Any]:
        for r, (p, w) in inputs.items():
            self.send(r, p, w)
        return {r: self.reply(r) for r in inputs}

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(10)
        del self.procs[rank], self.conns[rank]

    def close(self) -> None:
        for r, p in self.procs.items():
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                self.conns[r].send(("stop",))
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
        self.host_conn.send("stop")
        self.host.join(10)


@pytest.fixture
def fleet6() -> Iterator[Fleet]:
    f = Fleet(6)
    try:
        yield f
    finally:
        f.close()


def reference(inputs: dict[int, tuple[dict[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    total = sum(w for _, w in inputs.values())
    return {n: sum(w * p[n].double() for p, w in inputs.values()) / total for n in SHAPES}  # type: ignore[misc]


def assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for n in SHAPES:
        torch.testing.assert_close(got[n].double(), want[n].double(), rtol=1e-6, atol=1e-6)


def test_work_weighted_average_exact_and_zero_work_does_not_dilute(fleet6: Fleet) -> None:
    works = [0.0, 1.5, 2.0, 0.0, 3.0, 0.5]
    inputs = {r: (params_of(r, 1), works[r]) for r in range(6)}
    out = fleet6.round(inputs)
    want = reference({r: v for r, v in inputs.items() if v[1] > 0})   # only the ranks that worked
    for r, o in out.items():
        assert o["version"] == 1 and o["members"] == 6
        assert o["result"]["work_s"] == pytest.approx(sum(works))
        assert o["result"]["credited_s"] == works[r]
        assert_params(o["result"]["params"], want)
    # a round nobody worked in changes nothing and makes no version
    idle = fleet6.round({r: (params_of(r, 2), 0.0) for r in range(6)})
    assert all(o["result"] is None and o["version"] == 1 for o in idle.values())


def test_sigkill_mid_round_bounded_then_rejoin_with_latest(fleet6: Fleet) -> None:
    fleet6.round({r: (params_of(r, 1), 1.0) for r in range(6)})
    # round 2: rank 2 is SIGKILLed as the others enter the round's first collective
    inputs = {r: (params_of(r, 2), 1.0 + r) for r in range(6)}
    for r, (p, w) in inputs.items():
        fleet6.send(r, p, w)
    fleet6.kill(2)
    out = {r: fleet6.reply(r) for r in inputs if r != 2}
    want = reference({r: v for r, v in inputs.items() if r != 2})
    for o in out.values():
        assert o["t"] <= BOUND_S, f"round with a dead member took {o['t']:.1f} s (bound {BOUND_S} s)"
        assert o["version"] == 2 and o["members"] == 5
        assert_params(o["result"]["params"], want)
    latest = out[0]["result"]["params"]
    # the killed rank restarts: a new process that has trained nothing, from its own initial params
    fleet6.start(2)
    fleet6.conns[2].send(("join",))
    assert fleet6.reply(2) == "joined"
    inputs3 = {r: (out[r]["result"]["params"] if r != 2 else params_of(99, 0), 0.0 if r == 2 else 1.0)
               for r in range(6)}
    out3 = fleet6.round(inputs3)
    for o in out3.values():
        assert o["version"] == 3 and o["members"] == 6
    # the newcomer contributed no work, so version 3 is the survivors' average of version 2: it got
    # version 2 by broadcast, and its random start did not dilute anything
    assert_params(out3[2]["result"]["params"], latest)
    assert_params(out3[0]["result"]["params"], latest)
    # work: what every version holds is exactly the sum of what each member was credited
    credited = 6 * 1.0 + sum(1.0 + r for r in inputs if r != 2) + 5 * 1.0
    assert out3[0]["work_total_s"] == pytest.approx(credited)


def test_stalled_member_is_left_behind_within_the_bound_then_taken_back(fleet6: Fleet) -> None:
    fleet6.round({r: (params_of(r, 1), 1.0) for r in range(6)})
    os.kill(fleet6.procs[4].pid, signal.SIGSTOP)      # alive, sockets open, answers nothing
    inputs = {r: (params_of(r, 2), 1.0) for r in range(6) if r != 4}
    out = fleet6.round(inputs)
    for o in out.values():
        assert o["t"] <= BOUND_S, f"round with a stalled member took {o['t']:.1f} s (bound {BOUND_S} s)"
        assert o["version"] == 2 and o["members"] == 5
        assert_params(o["result"]["params"], reference(inputs))
    os.kill(fleet6.procs[4].pid, signal.SIGCONT)
    # the stalled member's own round fails (its group is gone); it comes back as a newcomer (asks
    # to join, as `round` does, here before the others' next round so that they see it there), it
    # receives version 2 and its work is counted once
    fleet6.conns[4].send(("join",))
    assert fleet6.reply(4) == "joined"
    fleet6.send(4, params_of(4, 2), 1.0)
    again = fleet6.round({r: (out[r]["result"]["params"], 0.5) for r in range(6) if r != 4})
    back = fleet6.reply(4)
    assert back["members"] == 6 and back["version"] == 3
    assert all(o["version"] == 3 and o["members"] == 6 for o in again.values())
    assert back["work_total_s"] == pytest.approx(6 * 1.0 + 5 * 1.0 + 5 * 0.5 + 1.0)


def test_a_minority_makes_no_version_and_keeps_its_work() -> None:
    """2 of 6 drafters alive: they must not combine into a version of their own (a split fleet
    would make two different versions of one number); the round ends within the bound, the work
    waits in each member for a majority."""
    f = Fleet(2, world=6)
    try:
        out = f.round({r: (params_of(r, 1), 1.0) for r in range(2)})
        for o in out.values():
            assert o["result"] is None and o["version"] == 0 and o["work_total_s"] == 0.0
            assert o["t"] <= BOUND_S + 1.0, f"took {o['t']:.1f} s"
    finally:
        f.close()


def test_store_host_lost_rounds_go_on_then_a_restarted_store_takes_a_re_form(fleet6: Fleet) -> None:
    """The store is only needed to form a group: without it a formed group goes on; a restarted
    (empty) store on the same port is found again and the next re-form happens there."""
    fleet6.round({r: (params_of(r, 1), 1.0) for r in range(6)})
    os.kill(fleet6.host.pid, signal.SIGKILL)
    fleet6.host.join(10)
    out = fleet6.round({r: (params_of(r, 2), 1.0) for r in range(6)})
    assert all(o["version"] == 2 and o["members"] == 6 for o in out.values())
    fleet6.host_conn, child = CTX.Pipe()
    fleet6.host = CTX.Process(target=_store, args=(child, fleet6.port), daemon=True)
    fleet6.host.start()
    assert fleet6.host_conn.recv() == fleet6.port
    inputs = {r: (out[r]["result"]["params"], 2.0) for r in range(6)}
    for r, (p, w) in inputs.items():
        fleet6.send(r, p, w)
    fleet6.kill(5)
    out3 = {r: fleet6.reply(r) for r in range(5)}
    for o in out3.values():
        assert o["t"] <= BOUND_S + TIMEOUT_S, f"took {o['t']:.1f} s"
        assert o["version"] == 3 and o["members"] == 5
        assert_params(o["result"]["params"], reference({r: v for r, v in inputs.items() if r != 5}))
    assert out3[0]["work_total_s"] == pytest.approx(6 + 6 + 5 * 2.0)


def test_resumed_version_reaches_everyone_and_numbering_goes_on(fleet6: Fleet) -> None:
    """Rank 5 restarts from a checkpoint holding version 7: the fresh group takes the newest
    version from it (the others' own params are rebased on it, their progress kept) and the
    next version is 8, never a number already exported."""
    ckpt = params_of(50, 7)
    fleet6.conns[5].send(("resume", 7, ckpt, 40.0))
    start = {r: params_of(r, 0) for r in range(6)}
    first = fleet6.round({r: (start[r] if r != 5 else ckpt, 0.0) for r in range(6)})   # nobody worked yet
    for r, o in first.items():
        assert o["version"] == 7 and o["work_total_s"] == 40.0
        if r != 5:      # a fresh member's progress since its start is nil: it gets version 7 itself
            assert_params(o["result"]["params"], ckpt)
    out = fleet6.round({r: (ckpt, 1.0) for r in range(6)})
    assert all(o["version"] == 8 and o["work_total_s"] == pytest.approx(46.0) for o in out.values())
    assert_params(out[0]["result"]["params"], ckpt)
