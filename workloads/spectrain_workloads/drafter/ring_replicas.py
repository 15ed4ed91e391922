"""A drafter's side of combining the replicas with engine AllReduce (drafter.allreduce): the same
interface as replicas.Replicas, the weights through a gloo ring all-reduce instead of the star.

The drafter.fleet still carries the samples; the weights never go through it. The exporting rank's
drafter hosts the drafters' TCPStore (`fleet_records.store_address`, or ENV_DRAFTER_STORE); every drafter,
the exporting one included, is a ring member (`allreduce.Combiner`).

Rounds run on a thread of their own, so the worker never waits for the ring: `round(...)` (the
worker's housekeeping) applies what the last round returned and, when one is due, hands the thread
a snapshot of the trainable parameters with the window work done since the last one. A result is
applied keeping the local progress made since that snapshot (`allreduce.apply`). Rounds are paced:
one every `combine_every_s`, and, after one that moved B bytes, none before B / bandwidthMBps
(`pace_s`), so the drafter's weight traffic stays within the exchange's bandwidth on average.
A worker late for a round (a long measurement) does not hold the ring up: its thread then takes
part with no new work on the last snapshot (`_next_job`), and the worker later applies the newest
result on top of everything it learnt since that snapshot.

Trust. gloo's transport is not authenticated, nor is the store (torch's TCPStore has no
authentication; it listens on the pod's own address only, listen.serve_store), so anything that
reaches those ports may read and write the store and join the sum: a NetworkPolicy must keep them
to the job's pods (docs/design.md, "Trust"). A result is checked exactly as the star's combined
versions are (drafter.checks: the local model's table, finite, an update no larger than
UPDATE_NORM_FACTOR x the local model's norm) before it is applied, else skipped and counted
(`exchangeRejectedByCause`, causes `allreduce_*`).

Bounds: a round takes at most 2 x `ring_timeout_s(combine_every_s)` + RENDEZVOUS_S (Combiner.round);
the final one at shutdown at most FINAL_ROUND_S; `close` interrupts the round in flight and waits
for the thread (a thread inside torch's collectives at interpreter exit aborts the process).

Attribution: a SUM all-reduce does not say who contributed what, so no rank knows the others'
share of a version: `combinedWorkSeconds`/`combinedSamples` are this rank's own work credited to
the versions (Result.credited_s), and the coordinator's per-rank maps (`exportWorkSecondsByRank`,
`exportSamplesByRank`) hold only its own rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from spectrain_workloads.drafter import checks
from spectrain_workloads.drafter.allreduce import Combiner, Result, apply
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.links import Rejected

RENDEZVOUS_S = 2.0          # Combiner's window to form a group once a member asked
# x the collective timeout: how late the worker may be before an idle round. Well below 1: the
# other members are already waiting in the collective, and a loaded host delays this thread too.
IDLE_GRACE = 0.2
FINAL_ROUND_S = 10.0        # at shutdown: the last round may take this long (inside the 30 s grace period)


def ring_timeout_s(combine_every_s: float) -> float:
    """A collective's timeout: a member enters a round up to one period after another (their rounds
    drift by the windows they are in), so at least `combine_every_s`, and never under 5 s."""
    return max(5.0, combine_every_s)


def pace_s(round_bytes: int, bandwidth_bytes_per_s: float, combine_every_s: float) -> float:
    """Seconds from one round's start to the next: the period, or longer when the round's bytes
    need longer at the exchange's bandwidth."""
    return max(combine_every_s, round_bytes / bandwidth_bytes_per_s)


def check_result(new: dict[str, torch.Tensor], local: dict[str, torch.Tensor], table: checks.ParamTable) -> str | None:
    """The cause a result is refused for (None: it may be applied): the local model's table and
    finite values (checks.check_weights), an update within checks.update_ok of the live model."""
    try:
        checks.check_weights(new, table)
    except Rejected as exc:
        return f"allreduce_{exc.cause}"
    if not checks.update_ok(new, local):
        return "allreduce_update"
    return None


def _host_copy(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters (each its own shape) copied to host memory: gloo sums CPU tensors, and the
    copies the ring keeps (snapshot, base, newest version) take none of the drafter's GPU share."""
    return {n: p.detach().to("cpu", copy=True) for n, p in params.items()}


class RingReplicas:
    joins_untrained = True      # a ring member takes part from the start (no work: it adds zeros)

    def __init__(self, fleet: Fleet, rank: int, log: Callable[..., None]) -> None:
        cfg = fleet.cfg
        assert cfg.store is not None, "engine AllReduce needs the store's address"
        self.fleet, self.rank, self.log = fleet, rank, log
        self.timeout_s = ring_timeout_s(cfg.combine_every_s)
        self.sync: dict[str, torch.Tensor] | None = None        # the live trainable parameters
        self.table: checks.ParamTable | None = None
        self.work_ns = 0                      # window work (train, optimizer steps) not yet contributed
        self.samples_at_contribution = 0
        self.uncredited_s, self.uncredited_samples = 0.0, 0    # contributed, not yet in a version
        self.version = 0                      # the fleet's newest version applied here
        self.work_s, self.samples = 0.0, 0    # this rank's work (and samples) held by versions
        self.bytes_sent = self.bytes_received = 0
        self.rounds = 0
        self._resume: tuple[int, float, dict[str, torch.Tensor]] | None = None
        self._next_at = 0.0                   # monotonic: no round starts before it
        self._cv = threading.Condition()
        self._job: tuple[dict[str, torch.Tensor], float] | None = None   # snapshot, work seconds
        self._in_round = False                # the thread is in a round (the worker's job or an idle one)
        self._last: dict[str, torch.Tensor] | None = None   # the last snapshot handed over (idle rounds)
        self._done: list[Result] = []         # results not yet taken, oldest first
        self._notes: list[tuple[str, dict[str, Any]]] = []  # the thread's events, logged by the worker
        self.idle_rounds = 0
        self._stop = threading.Event()
        self._combiner: Combiner | None = None
        self._thread = threading.Thread(target=self._run, name=f"drafter-ring-{rank}", daemon=True)

    @property
    def is_coordinator(self) -> bool:
        return self.fleet.is_coordinator

    @property
    def _busy(self) -> bool:
        """A job handed over whose round has not ended."""
        return self._job is not None or self._in_round

    # ------------------------------------------------------------------ the worker's side
    def start(self, model: torch.nn.Module, samples_trained: int, version: int,
              state: dict[str, Any] | None = None) -> None:
        """The trainer exists (fresh or resumed). `state` (state_dict, from the checkpoint) holds the
        fleet version the checkpointed model carries: it rejoins from there, and from the newest
        version in the group when another member holds a newer one."""
        self.sync = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.table = checks.param_table(self.sync)
        self.fleet.expect(self.sync)          # the samples are checked against the target
        self.samples_at_contribution = samples_trained
        if self._thread.is_alive():
            return
        if state and int(state.get("ring_version", 0)) > 0:
            self.version = int(state["ring_version"])
            snapshot = _host_copy(self.sync)
            self._resume = (self.version, float(state.get("ring_work_total_s", 0.0)), snapshot)
        self._thread.start()

    def state_dict(self) -> dict[str, Any]:
        c = self._combiner
        return {"ring_version": self.version, "ring_work_total_s": c.work_total_s if c is not None else 0.0}

    def round(self, samples_trained: int, next_version: int, *, force: bool = False) -> Result | None:
        """Apply what the last round returned; start the next one when due. A result the coordinator
        applied is returned: the worker exports it (as `next_version`, its own numbering)."""
        made = self._take()
        now = time.monotonic()
        with self._cv:        # decided with the thread's idle rounds, which move `_next_at` too
            go = (force or now >= self._next_at) and not self._busy
            if go:
                self._next_at = now + self.pace()
        if go:
            self._submit(samples_trained)
        return made

    def final_round(self, samples_trained: int, next_version: int) -> Result | None:
        """The job ended: the round in flight, then one last round with the work since, all within
        FINAL_ROUND_S; what the coordinator applied last is returned (to export)."""
        deadline = time.monotonic() + FINAL_ROUND_S
        made = self._await(deadline)
        if self._busy or self._combiner is None:     # still in flight, or never reached the store
            return made
        self._submit(samples_trained)
        return self._await(deadline) or made

    def close(self) -> None:
        """End the ring's thread (the round in flight is interrupted) and wait for it: a thread still
        inside torch's collectives when the interpreter exits aborts the process."""
        self._stop.set()
        c = self._combiner
        if c is not None:
            c.interrupt()
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive():
            # a round ends within INTERRUPT_S of `interrupt`; connecting to the store within timeout_s
            self._thread.join(self.timeout_s + RENDEZVOUS_S)

    def pace(self) -> float:
        return pace_s(self.round_bytes(), self.fleet.cfg.bandwidth_bytes_per_s, self.fleet.cfg.combine_every_s)

    def round_bytes(self) -> int:
        """What one round moves per rank, at most: fp32 on the wire, the ring's 2 (N-1)/N < 2 x the
        model's bytes."""
        return 2 * 4 * sum(p.numel() for p in (self.sync or {}).values())

    # ------------------------------------------------------------------ rounds
    def _submit(self, samples_trained: int) -> None:
        assert self.sync is not None
        work_s, self.work_ns = self.work_ns / 1e9, 0
        self.uncredited_s += work_s
        self.uncredited_samples += samples_trained - self.samples_at_contribution
        self.samples_at_contribution = samples_trained
        # taken here, between the worker's steps: the thread must not read parameters being updated
        snapshot = _host_copy(self.sync)
        with self._cv:
            self._job = (snapshot, work_s)
            self._cv.notify_all()

    def _await(self, deadline: float) -> Result | None:
        with self._cv:
            self._cv.wait_for(lambda: not self._busy, max(0.0, deadline - time.monotonic()))
        return self._take()

    def _take(self) -> Result | None:
        """Account every result that came (work credited, bytes), apply the newest: each one's base
        is the snapshot it was combined from, so the newest alone keeps all local progress since."""
        with self._cv:
            done, self._done = self._done, []
            notes, self._notes = self._notes, []
        for event, fields in notes:
            self.log(event, **fields)
        for res in done:
            self._account(res)
        return self._apply(done[-1]) if done else None

    def _account(self, res: Result) -> None:
        self.rounds += 1
        if res.work_s > 0:          # a round: fp32 through the ring both ways (a version received: one way)
            moved = self.round_bytes() * (res.members - 1) // res.members
            self.bytes_sent += moved
            self.bytes_received += moved
        else:
            self.bytes_received += self.round_bytes() // 2
        if res.credited_s > 0:      # this rank's work is in the fleet's version now, applied or not
            share = min(1.0, res.credited_s / self.uncredited_s) if self.uncredited_s > 0 else 1.0
            samples = round(self.uncredited_samples * share)
            self.work_s += res.credited_s
            self.samples += samples
            self.uncredited_s = max(0.0, self.uncredited_s - res.credited_s)
            self.uncredited_samples -= samples

    def _apply(self, res: Result) -> Result | None:
        assert self.sync is not None and self.table is not None
        cause = check_result(res.params, self.sync, self.table)
        if cause is not None:
            self.fleet.stats.reject(cause)
            self.log("combine_rejected", version=res.version, cause=cause)
            return None
        apply(self.sync, res)       # params <- result + (params_now - snapshot)
        self.version = res.version
        self.log("combined", version=res.version, members=res.members, work_s=res.work_s, credited_s=res.credited_s)
        return res if self.is_coordinator else None

    def _run(self) -> None:
        """The ring's thread: connect (the store's host may start later), then one round per job."""
        cfg = self.fleet.cfg
        assert cfg.store is not None
        while self._combiner is None and not self._stop.is_set():
            try:
                self._combiner = Combiner(self.rank, cfg.world, cfg.store, self.timeout_s,
                                          host_store=self.is_coordinator, store_bind=cfg.bind_hosts[0],
                                          rendezvous_s=RENDEZVOUS_S)
            except (RuntimeError, OSError) as exc:   # not up yet (the client waited timeout_s for it)
                self._note("ring_connect_failed", error=str(exc)[:200])
                self._stop.wait(1.0)
        c = self._combiner
        if c is None:
            return
        if self._stop.is_set():          # closed while connecting: `close` found no combiner to interrupt
            c.close()
            return
        if self._resume is not None:
            c.resume(self._resume[0], self._resume[2], self._resume[1])
            self._resume = None
        c.join()       # counted before the members' next round
        while not self._stop.is_set():
            job = self._next_job()
            if job is None:
                continue
            try:
                res = c.round(*job)
            except Exception as exc:  # a ring fault is the ring's, never the worker's: the work waits
                self._note("ring_error", error=f"{type(exc).__name__}: {exc}"[:300])
                res = None
            with self._cv:
                if res is not None:
                    self._done.append(res)
                self._in_round = False
                self._cv.notify_all()
        c.close()

    def _next_job(self) -> tuple[dict[str, torch.Tensor], float] | None:
        """The worker's next snapshot; or, when the worker has not handed one over IDLE_GRACE x the
        timeout after a round was due (a long measurement, a busy window), a round of no work on the
        last snapshot, so that the other members' collectives do not time out and re-form the group
        without this one (its contribution weighs nothing; applying the result keeps the progress
        made since that snapshot). None: stopped, or nothing yet."""
        with self._cv:
            def due() -> float:
                return self._next_at + IDLE_GRACE * self.timeout_s - time.monotonic()
            self._cv.wait_for(lambda: self._job is not None or self._stop.is_set()
                              or (self._last is not None and due() <= 0),
                              None if self._last is None else max(0.0, due()))
            if self._stop.is_set():
                return None
            if self._job is not None:
                job, self._job = self._job, None
                self._last, self._in_round = job[0], True
                return job
            if self._last is None or due() > 0:
                return None
            self._next_at = time.monotonic() + self.pace()
            self.idle_rounds += 1
            self._in_round = True
            return self._last, 0.0

    def _note(self, event: str, **fields: Any) -> None:
        with self._cv:
            self._notes.append((event, fields))

    def summary(self) -> dict[str, Any]:
        st = self.fleet.stats.snapshot()
        rejected = dict(sorted(self.fleet.stats.rejected().items()))
        own = {str(self.rank): self.work_s} if self.is_coordinator else {}
        own_samples = {str(self.rank): self.samples} if self.is_coordinator else {}
        return {"fleetRole": "ring",
                "combinedVersion": self.version, "combinedWorkSeconds": self.work_s, "combinedSamples": self.samples,
                "exportWorkSecondsByRank": own, "exportSamplesByRank": own_samples,
                "samplesShared": st.get("samples_shared", 0), "samplesFromPeers": st.get("samples_received", 0),
                "exchangeBytesSent": st.get("sent_bytes", 0) + self.bytes_sent,
                "exchangeBytesReceived": st.get("received_bytes", 0) + self.bytes_received,
                "exchangeFramesDropped": st.get("dropped", 0) + st.get("inbox_dropped", 0),
                "exchangeRejected": sum(rejected.values()), "exchangeRejectedByCause": rejected,
                "weightFramesSent": st.get("weight_frames_sent", 0), "ringRounds": self.rounds,
                "ringIdleRounds": self.idle_rounds}


__all__ = ["FINAL_ROUND_S", "RingReplicas", "check_result", "pace_s", "ring_timeout_s"]
