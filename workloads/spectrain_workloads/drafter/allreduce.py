"""The drafters' weights combined by a ring all-reduce (torch.distributed gloo), not through one
coordinator: per-rank traffic per round is ~2 x the model's bytes whatever the fleet's size.

Semantics are those of `fleet.Fleet.combine` (periodic model averaging, DiLoCo with an outer
learning rate of 1): each round every live member contributes its parameters weighted by the
window work no combined version holds yet. A float64 SUM all-reduce of [w_i, joiners seen,
version] (exact work, agreement on membership) is followed by an fp32 SUM all-reduce of
w_i * p_i; divided by sum(w_i) that is the work-weighted average, so a member without new work
adds zeros and dilutes nobody, and a round nobody worked in makes no version. The caller keeps
its local progress: `params <- combined + (params_now - base)` (`apply`), `base` being what it
passed in.

Membership. The drafters rendezvous on their own TCPStore (own port: never the target's
MASTER_PORT, store or process groups; the target takes no part). A group is formed per *epoch*
(`rdv<e>/...` keys, a fresh ProcessGroupGloo under the prefix `pg<e>`), ordered by rank so that
ring neighbours are mostly on the same node. A group lasts while nothing changes; it is re-formed
when a collective fails (a member died: its sockets close and the error runs round the ring as
each survivor aborts its group; a stalled member: the collective's timeout) or when a (re)started
process asks to join (the `joiners` counter, agreed through the first all-reduce of a round).
Only a majority of `world` makes versions, so a fleet can never split into two groups that both
make a "version v". A new group first brings every member to the newest combined version
(broadcast from its holder), so a restarted drafter starts from the latest version; work that
reached a version is never counted again nor lost: a member whose failed round completed
elsewhere learns it from the round id of the version it receives.

Bounds: a round returns within `2 * timeout_s + rendezvous_s` (a failed attempt, a rendezvous,
one more attempt); past that it returns what it received, or None, with its work kept for the
next round; `interrupt()` (from another thread, at shutdown) ends it within INTERRUPT_S. The store
is needed only to form a group: while its host is down a formed group goes on; a restarted (empty)
store is found again and the members start over there as newcomers.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from spectrain_workloads.listen import serve_store

JOINERS = "joiners"     # store counter: processes that asked to join since the store started
STORE_ID = "store_id"   # written by the store's host: a new id means a restarted, empty store
EPOCH = "epoch"         # store key: the newest sealed epoch (a joiner's starting point)
INTERRUPT_S = 1.0       # longest a rendezvous wait goes without looking at `interrupted`


class NoQuorum(RuntimeError):
    """A group formed of fewer than a majority of the drafters: it makes no version."""


class _Reform(Exception):
    """A process asked to join: the group is re-formed before this round."""


@dataclass
class Result:
    """One round's outcome for this member."""
    params: dict[str, torch.Tensor]   # the combined version (or the newest one received on joining)
    base: dict[str, torch.Tensor]     # what the caller passed: apply `params + (now - base)`
    version: int
    work_s: float                     # work in this version's round (0: a version only received)
    work_total_s: float               # work in this version and every earlier one (cumulative)
    members: int
    credited_s: float                 # this member's work that this result newly holds
    round_id: str


@dataclass
class _Sent:
    round_id: str
    snapshot: dict[str, torch.Tensor]
    work_s: float


class Combiner:
    """One drafter's side. `round` runs on the drafter's housekeeping thread, between windows."""

    def __init__(self, rank: int, world: int, store_addr: tuple[str, int], timeout_s: float, *,
                 host_store: bool = False, store_bind: str | None = None, rendezvous_s: float = 2.0,
                 join_wait_s: float | None = None) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.rendezvous_s = rendezvous_s
        # a fresh process waits longer than a member for a group: the others only notice it at
        # their next round (combine_every_s), and sealing alone would split the fleet
        self.join_wait_s = 2 * timeout_s if join_wait_s is None else join_wait_s
        self.incarnation = uuid.uuid4().hex[:12]
        self.store_addr, self.host_store, self.store_bind = store_addr, host_store, store_bind
        self.store, self.store_id = self._connect()
        self.pg: Any = None       # dist.ProcessGroupGloo (its stubs lack the collectives)
        self.epoch, self.size, self.index, self.seq, self.joiners_at_form = 0, 0, -1, 0, 0
        self.version, self.work_total_s, self.round_id = 0, 0.0, ""
        self.latest: dict[str, torch.Tensor] | None = None    # the combined params of `version`
        self.anchor: dict[str, torch.Tensor] | None = None    # what the caller's params are relative to
        self.uncredited_s = 0.0                                # own work no version holds yet
        self.sent: _Sent | None = None                         # the last contribution not known combined
        self.announced = False
        self.interrupted = False   # set by `interrupt` (another thread): rounds end, no new attempt

    # ------------------------------------------------------------------ public
    def join(self) -> None:
        """Ask the members to take this (re)started process in at their next round (`round` does it
        too; call this just before the first `round` to have it counted before the members' next)."""
        if not self.announced:
            self.store.add(JOINERS, 1)
            self.announced = True

    def resume(self, version: int, params: dict[str, torch.Tensor], work_total_s: float) -> None:
        """A restarted drafter holding a combined version from its checkpoint (before its first
        round): the newest version in a new group is the fleet's, so numbers never go back."""
        self.version, self.work_total_s = version, work_total_s
        self.latest = {n: p.detach().clone() for n, p in params.items()}
        self.anchor = self.latest

    def round(self, params: dict[str, torch.Tensor], work_s: float) -> Result | None:
        """Combine `params` (with `work_s` seconds of new work) with every live member's. None:
        nothing to apply (nobody worked, or no group within the bound; the work waits)."""
        self.uncredited_s += work_s
        base = {n: p.detach().clone() for n, p in params.items()}
        mine = base
        if self.anchor is None:
            self.anchor = base
        caught_up: Result | None = None
        deadline = time.monotonic() + 2 * self.timeout_s + self.rendezvous_s
        while time.monotonic() < deadline and not self.interrupted:
            try:
                if self.pg is None:
                    got = self._form(deadline)
                    if got is not None:   # a newer version: rebase this round's contribution on it
                        mine = self._rebase(mine, got, base)
                        # what the caller applies if no round follows: the version, its own
                        # progress since the version it had kept on top
                        got.params, got.base = mine, base
                        caught_up = got
                res = self._reduce(mine, base)
            # a member died or stalled (DistError is a RuntimeError), or no majority yet (NoQuorum),
            # or a newcomer to take in
            except (RuntimeError, TimeoutError, _Reform):
                self._drop()
                self._check_store()
                continue
            return res or caught_up
        return caught_up

    def close(self) -> None:
        self._drop()

    def interrupt(self) -> None:
        """From another thread: end the round in progress soon (its collective fails: the group is
        aborted) and start no other; the process is about to leave."""
        self.interrupted = True
        pg = self.pg
        if pg is not None:
            pg.abort()

    # ------------------------------------------------------------------ one round
    def _reduce(self, mine: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> Result | None:
        assert self.pg is not None
        names = sorted(mine)
        w = self.uncredited_s
        # agreed first (cheap; a dead member shows here before the big one), in float64 so that
        # work adds up exactly: the work, whether anyone saw a joiner, the version (equal in a group)
        head = torch.tensor([w, float(self._joiners()), float(self.version)], dtype=torch.float64)
        self._wait(self.pg.allreduce([head], _op(dist.ReduceOp.SUM)))
        if head[1] > self.size * self.joiners_at_form:
            raise _Reform()
        total = float(head[0])
        if total <= 0:      # nobody worked (all agree: same sums): nothing combined, no params change
            return None
        round_id = f"{self.epoch}.{self.seq}"          # epochs are numbered by the store: unique
        self.sent = _Sent(round_id, mine, w)
        # fp32 on the wire (the drafter trains in fp32): 2 x the model's bytes per rank per round
        flat = torch.cat([mine[n].detach().to(torch.float32).flatten() * w for n in names])
        self._wait(self.pg.allreduce([flat], _op(dist.ReduceOp.SUM)))
        self.seq += 1
        combined, offset = {}, 0
        for n in names:
            k = mine[n].numel()
            combined[n] = (flat[offset:offset + k] / total).to(mine[n].dtype).reshape(mine[n].shape)
            offset += k
        self.version = round(float(head[2]) / self.size) + 1
        self.work_total_s += total
        self.latest, self.anchor, self.round_id = combined, combined, round_id
        credited, self.uncredited_s, self.sent = w, self.uncredited_s - w, None
        return Result(combined, base, self.version, total, self.work_total_s, self.size, credited, round_id)

    # ------------------------------------------------------------------ the store
    def _connect(self) -> tuple[dist.TCPStore, str]:
        if self.host_store:
            store = start_store(self.store_bind or self.store_addr[0], self.store_addr[1], self.timeout_s)
        else:
            store = dist.TCPStore(self.store_addr[0], self.store_addr[1], is_master=False,
                                  wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s))
        return store, store.get(STORE_ID).decode()

    def _joiners(self) -> int:
        """The joiners counter; while the store is unreachable a formed group goes on without it
        (collectives do not use the store), and nobody new can join anyway."""
        try:
            return int(self.store.add(JOINERS, 0))
        except RuntimeError:
            return self.joiners_at_form

    def _check_store(self) -> None:
        """After a failure: reconnect if the store went away. A restarted store is empty, so this
        member starts over as a newcomer there (its version and work are kept, not the numbering)."""
        try:
            self.store.add(JOINERS, 0)
            return
        except RuntimeError:
            pass
        try:
            store, sid = self._connect()
        except RuntimeError:       # still down: the round's bound ends the attempts
            return
        self.store = store
        if sid != self.store_id:
            self.store_id, self.epoch, self.size, self.announced = sid, 0, 0, False

    # ------------------------------------------------------------------ membership
    def _form(self, deadline: float) -> Result | None:
        """Rendezvous into a new group, then bring every member to the newest version. Returns the
        version received when it is newer than this member's."""
        sealed = int(self.store.add(EPOCH, 0))
        # a newcomer: a new process, or one left behind by a group formed without it (stalled).
        # It is counted when it comes, not before (members re-form for it only when it can join),
        # and waits for the members' next round rather than sealing a group of its own
        fresh = self.size == 0 or self.epoch < sealed
        if fresh:
            self.join()
        e = max(self.epoch, sealed) + 1
        expect = self.world if fresh else self.size + max(0, int(self.store.add(JOINERS, 0)) - self.joiners_at_form)
        info = {"rank": self.rank, "inc": self.incarnation,
                "version": self.version if self.latest is not None else 0,
                "round_id": self.round_id, "work_total_s": self.work_total_s}
        while True:
            if time.monotonic() >= deadline:
                raise TimeoutError("no group within the round's bound")
            idx = self.store.add(f"rdv{e}/n", 1) - 1
            self.store.set(f"rdv{e}/m{idx}", json.dumps(info))
            if idx + 1 >= expect:
                self._seal(e)
            wait = self.join_wait_s if fresh else self.rendezvous_s
            window_end = time.monotonic() + max(0.1, min(wait, deadline - time.monotonic()))
            while True:         # in slices of at most INTERRUPT_S, so that `interrupt` is seen
                try:
                    self.store.wait([f"rdv{e}/seal"],
                                    timedelta(seconds=max(0.05, min(INTERRUPT_S, window_end - time.monotonic()))))
                    break
                except RuntimeError:
                    if self.interrupted:
                        raise TimeoutError("interrupted") from None
                    if time.monotonic() >= window_end:   # the window is over: close the group with whoever arrived
                        self._seal(e)
                        break
            seal = json.loads(self.store.get(f"rdv{e}/seal"))
            if idx < seal["n"]:
                break
            # late for this one: the group takes us in at its next round; until then wait as a
            # newcomer does (sealing alone after a member's short window would split the fleet)
            self.store.add(JOINERS, 1)
            fresh = True
            e += 1
        members = [json.loads(self.store.get(f"rdv{e}/m{i}")) for i in range(seal["n"])]
        if len(members) < self.world // 2 + 1:
            # only a majority makes versions: two groups can then never both go on (a split fleet
            # would make two different "version v"); a minority waits as newcomers for the majority
            self.epoch, self.size, self.announced = e, 0, False
            raise NoQuorum(f"{len(members)} of {self.world} drafters")
        order = sorted(range(len(members)), key=lambda i: (members[i]["rank"], members[i]["inc"]))
        self.epoch, self.size, self.seq, self.joiners_at_form = e, len(members), 0, seal["joiners"]
        self.announced = False      # in a group now: a later re-form as a newcomer counts again
        self.index = order.index(idx)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pg{e}", self.store), self.index, self.size,
                                        timedelta(seconds=self.timeout_s))
        newest = max(m["version"] for m in members)
        if all(m["version"] == newest for m in members):
            return None
        src_i = min((i for i, m in enumerate(members) if m["version"] == newest), key=order.index)
        src = members[src_i]
        template = self.latest if self.latest is not None else self.anchor
        assert template is not None
        names = sorted(template)
        flat = (torch.cat([self.latest[n].to(torch.float32).flatten() for n in names]) if self.index == order.index(src_i)
                and self.latest is not None else torch.zeros(sum(template[n].numel() for n in names)))
        opts = dist.BroadcastOptions()
        opts.rootRank = order.index(src_i)
        self._wait(self.pg.broadcast([flat], opts))
        if self.version == newest and self.latest is not None:
            return None
        got, offset = {}, 0
        for n in names:
            k = template[n].numel()
            got[n] = flat[offset:offset + k].to(template[n].dtype).reshape(template[n].shape)
            offset += k
        credited = 0.0
        if self.sent is not None and self.sent.round_id == src["round_id"]:
            credited = self.sent.work_s      # the round that failed here completed elsewhere, with our work
            self.uncredited_s -= credited
        self.version, self.work_total_s, self.round_id = newest, float(src["work_total_s"]), src["round_id"]
        self.latest = got
        return Result(got, {}, newest, 0.0, self.work_total_s, self.size, credited, src["round_id"])

    def _rebase(self, mine: dict[str, torch.Tensor], got: Result, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This member's params moved onto the version just received, its local progress kept (from
        the contribution that version holds, or from the version it was last given)."""
        ref = self.sent.snapshot if self.sent is not None and got.credited_s > 0 else self.anchor
        assert ref is not None
        self.sent = None
        out = {n: got.params[n] + (mine[n] - ref[n]) for n in mine}
        self.anchor = got.params
        return out

    def _seal(self, e: int) -> None:
        n = int(self.store.add(f"rdv{e}/n", 0))
        seal = json.dumps({"n": n, "joiners": int(self.store.add(JOINERS, 0))})
        if self.store.compare_set(f"rdv{e}/seal", "", seal).decode() == seal:
            self.store.set(EPOCH, str(e))

    def _wait(self, work: dist.Work) -> None:
        if not work.wait(timedelta(seconds=self.timeout_s)):
            raise TimeoutError("collective timed out")

    def _drop(self) -> None:
        """Leave the group: its sockets close, which fails the neighbours' pending operations at once."""
        if self.pg is not None:
            pg, self.pg = self.pg, None
            pg.abort()
            del pg


def start_store(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """The drafters' store, served by this process (a member with `host_store`, or a process that
    only hosts it) on `host` only (the pod's address: listen.serve_store). Port 0: any free port
    (`.port`)."""
    store: dist.TCPStore = serve_store(host, port, timeout=timedelta(seconds=timeout_s))
    store.set(STORE_ID, uuid.uuid4().hex)
    return store


def _op(op: dist.ReduceOp.RedOpType) -> dist.AllreduceOptions:
    o = dist.AllreduceOptions()
    o.reduceOp = op  # type: ignore[assignment]  # the stubs want the ReduceOp wrapper; both work
    return o


def apply(model_params: dict[str, torch.Tensor], result: Result) -> None:
    """Set the caller's live parameters to the result, keeping the progress made since `base`."""
    with torch.no_grad():
        for n, p in model_params.items():
            if n in result.params:
                delta = p - result.base[n].to(p.device, p.dtype) if n in result.base else 0
                p.copy_(result.params[n].to(p.device, p.dtype) + delta)


__all__ = ["Combiner", "NoQuorum", "Result", "apply", "start_store"]
