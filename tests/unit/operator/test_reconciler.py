"""Reconciler against an in-memory fake of kube.Kube: requeue timers, status writes, peering."""

from __future__ import annotations

import copy
import random
import threading
from typing import Any

import pytest

from spectrain_operator import reconciler as recmod
from spectrain_operator.kube import UNREADABLE_KINDS, UnverifiedConflict
from spectrain_operator.ratelimit import Backoff
from spectrain_operator.reconciler import Reconciler
from tests.waiting import wait_for

Obj = dict[str, Any]
NS = "team"


class FakeKube:
    """Just enough of kube.Kube: one job, its children and pods in dicts."""

    def __init__(self, job: Obj):
        self.job = job
        self.objects: dict[tuple[str, str], Obj] = {}
        self.creates: list[tuple[str, str]] = []
        self.annotated: list[tuple[str, dict[str, str]]] = []

    def get_job(self, namespace: str, name: str) -> Obj | None:
        return copy.deepcopy(self.job)

    def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        return [copy.deepcopy(o) for (kind, _), o in sorted(self.objects.items()) if kind == "Pod"]

    def create(self, obj: Obj) -> Obj | None:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            if obj["kind"] in UNREADABLE_KINDS:   # as kube.Kube: whose it is cannot be checked
                raise UnverifiedConflict(obj)
            return None
        self.objects[key] = copy.deepcopy(obj)
        self.creates.append(key)
        return obj

    def delete_pod(self, namespace: str, name: str, *, grace_seconds: int | None = None) -> None:
        self.objects.pop(("Pod", name), None)

    def delete_secret(self, namespace: str, name: str) -> None:
        self.objects.pop(("Secret", name), None)

    def patch_status(self, namespace: str, name: str, status: Obj, old: Obj | None = None,
                     attempts: int | None = None) -> None:
        """kube.Kube.patch_status as the API server applies it: a JSON merge patch (RFC 7386)."""
        body = dict(status)
        for key in old or {}:
            body.setdefault(key, None)
        self.job["status"] = merge_patch(self.job.get("status") or {}, body)

    def post_event(self, job: Obj, event: Any) -> None:
        pass

    def missing_claims(self, namespace: str, claims: list[str]) -> list[str]:
        return []

    def delete_job(self, namespace: str, name: str) -> None:
        pass

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self.annotated.append((name, dict(annotations)))
        self.objects[("Pod", name)]["metadata"].setdefault("annotations", {}).update(annotations)

    def pod(self, name: str) -> Obj:
        return self.objects[("Pod", name)]


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def job(labels: dict[str, str] | None = None, **spec: Any) -> Obj:
    base: Obj = {"target": {"image": "img:1", "nodes": 2, "steps": 10, "checkpoint": {"claimName": "run"},
                            "parallelism": {"data": 1, "pipeline": 2, "microbatches": 2}},
                 "runPolicy": {"backoffSeconds": 0},
                 "scheduling": {"nodeSelector": {"team": "a"}}}
    base.update(spec)
    return {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob",
            "metadata": {"name": "k", "namespace": NS, "uid": "uid-1", "generation": 1, "labels": labels or {}},
            "spec": base}


def test_a_requeue_asked_for_by_a_timer_fired_pass_is_not_lost() -> None:
    """A pass run by a requeue timer that asks for another requeue (e.g. a job that finishes in a
    timer-fired pass and now waits for its TTL) must get one: the firing timer is not pending."""
    passes: list[float] = []
    done = threading.Event()

    class Chained(Reconciler):
        def reconcile_once(self, namespace: str, name: str) -> None:  # type: ignore[override]
            passes.append(1.0)
            if len(passes) < 3:
                self.requeue(namespace, name, 0.01)
            else:
                done.set()

    r = Chained(FakeKube(job()))  # type: ignore[arg-type]
    try:
        r.trigger(NS, "k")
        wait_for(done.is_set, 10, what="three chained passes (the second requeue was dropped)")
    finally:
        r.close()
    assert len(passes) == 3


def test_an_earlier_pending_requeue_is_kept_and_a_later_one_merged() -> None:
    fired: list[str] = []
    r = Reconciler(FakeKube(job()))  # type: ignore[arg-type]
    r.reconcile_once = lambda ns, name: fired.append(name)  # type: ignore[assignment, method-assign, return-value]
    try:
        r.requeue(NS, "k", 0.3)
        r.requeue(NS, "k", 30.0)  # later: the pending earlier timer covers it
        wait_for(lambda: fired, 10, what="the earlier requeue")
        assert fired == ["k"]
    finally:
        r.close()


def test_a_deleted_queued_job_marks_its_pod_group_done_for_kueue() -> None:
    """Kueue keeps a pod group's ended pods (its finalizer) and its quota until the group is done:
    once the job is gone, the operator says so on the pods Kueue still holds."""
    kube = FakeKube(job({"kueue.x-k8s.io/queue-name": "lq"}))
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        r.reconcile_once(NS, "k")
        kube.pod("k-0")["metadata"]["finalizers"] = ["kueue.x-k8s.io/managed"]  # Kueue's webhook put it
        r.deleted(NS, "k", kube.job)
        assert kube.annotated == [("k-0", {"kueue.x-k8s.io/retriable-in-group": "false"})]
        r.deleted(NS, "k", kube.job)  # a replayed event: nothing twice
        assert len(kube.annotated) == 1
        plain = FakeKube(job())
        r.close()
        r = Reconciler(plain)  # type: ignore[arg-type]
        r.deleted(NS, "k", plain.job)  # not queued: no pod list, nothing to say
        assert plain.annotated == []
    finally:
        r.close()


def test_a_status_differing_only_by_nulls_is_not_rewritten() -> None:
    kube = FakeKube(job())
    writes: list[Obj] = []
    patch = kube.patch_status
    kube.patch_status = lambda ns, name, st, old=None, **kw: (writes.append(st), patch(ns, name, st, old))  # type: ignore[method-assign]
    r = Reconciler(kube)  # type: ignore[arg-type]
    r.reconcile_once(NS, "k")
    # the fleet identities' record (before the pods), then the pass's status
    assert [list(w) for w in writes[:-1]] == [["fleetIdentityGenerations"]]
    assert writes[-1]["drafter"].get("acceptanceLength", "absent") is None  # a null the server drops
    r.reconcile_once(NS, "k")
    r.reconcile_once(NS, "k")
    assert len(writes) == 2
    r.close()


def test_the_pods_reports_are_kept_and_those_of_pods_gone_deleted() -> None:
    """status.reports is the pods' (podstatus writes it): a pass reads rank 0's progress from it and
    never writes it back, except to delete the reports of pods that no longer exist."""
    kube = FakeKube(job())
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        r.reconcile_once(NS, "k")
        for i in (0, 1):
            kube.pod(f"k-{i}")["metadata"]["uid"] = f"pod-uid-{i}"
        kube.job["status"]["reports"] = {"pod-uid-0": {"pod": "k-0", "progress": '{"step": 4}'},
                                         "gone-uid": {"pod": "k-1", "progress": '{"step": 1}'}}
        r.reconcile_once(NS, "k")
        assert kube.job["status"]["progress"]["step"] == 4
        assert kube.job["status"]["reports"] == {"pod-uid-0": {"pod": "k-0", "progress": '{"step": 4}'}}
        kube.job["status"]["reports"]["pod-uid-1"] = {"pod": "k-1", "drafter": '{"state": "Active"}'}
        r.reconcile_once(NS, "k")
        assert set(kube.job["status"]["reports"]) == {"pod-uid-0", "pod-uid-1"}
        assert kube.job["status"]["drafter"]["activeRanks"] == 1
    finally:
        r.close()


def test_every_pass_arms_the_resync_and_a_transient_error_a_retry() -> None:
    kube = FakeKube(job())
    r = Reconciler(kube, resync_s=600.0, retry=Backoff(40.0, 80.0, random.Random(5)))  # type: ignore[arg-type]
    try:
        r.handle(NS, "k")
        assert 590 < (r._timers.pending((NS, "k")) or 0) <= 600   # the resync replaces kopf's timer

        retry_after: list[float | None] = [None]

        def unavailable(namespace: str, name: str) -> None:
            raise recmod.TransientError("GET: 503 busy", 503, retry_after[0])

        r.forget(NS, "k")
        kube.get_job = unavailable  # type: ignore[method-assign, assignment]
        r.handle(NS, "k")   # logged, not raised: the handlers never see an exception
        assert 0 < (r._timers.pending((NS, "k")) or 0) <= 40    # first failure: a draw in [0, base]
        r._timers.cancel((NS, "k"))
        r.handle(NS, "k")
        assert 0 < (r._timers.pending((NS, "k")) or 0) <= 80    # second: the ceiling doubled
        r._timers.cancel((NS, "k"))
        retry_after[0] = 300.0
        r.handle(NS, "k")
        assert 299 < (r._timers.pending((NS, "k")) or 0) <= 300  # the server's Retry-After wins
        r.forget(NS, "k")
        assert (NS, "k") not in r._failures
    finally:
        r.close()


def test_a_replica_paused_by_peering_does_not_reconcile_on_its_timers() -> None:
    fired: list[str] = []
    r = Reconciler(FakeKube(job()), resync_s=300.0)  # type: ignore[arg-type]
    r.reconcile_once = lambda ns, name: fired.append(name)  # type: ignore[assignment, method-assign, return-value]
    try:
        r.active = False
        r.requeue(NS, "k", 0.01)
        # the due timer re-arms itself at the resync instead of running a pass
        wait_for(lambda: (r._timers.pending((NS, "k")) or 0) > 200, 10, what="the timer re-armed at the resync")
        assert fired == []
        r.active = True
        r.requeue(NS, "k", 0.01)
        wait_for(lambda: fired, 10, what="a pass once active again")
    finally:
        r.close()


def test_a_follower_acts_on_nothing_and_the_gate_follows_the_lease() -> None:
    from spectrain_operator import handlers

    class Elector:
        leading = False

        def is_leader(self) -> bool:
            return self.leading

    kube = FakeKube(job())
    r = Reconciler(kube)  # type: ignore[arg-type]
    elector = Elector()
    handlers.install(r, elector)  # type: ignore[arg-type]
    try:
        r.handle(NS, "k")
        handlers.job_event(type="ADDED", body=job(), namespace=NS, name="k")
        assert kube.creates == [] and r.passes == 0
        elector.leading = True
        r.handle(NS, "k")
        assert kube.creates and r.passes == 1
    finally:
        r.close()

def test_which_job_events_need_a_pass() -> None:
    from spectrain_operator.handlers import needs_pass

    meta = {"name": "k", "generation": 3}
    assert needs_pass(None, {"metadata": meta})                      # initial listing: resume
    assert needs_pass("ADDED", {"metadata": meta})
    assert not needs_pass("MODIFIED", {"metadata": meta, "status": {"observedGeneration": 3}})   # our own write
    assert needs_pass("MODIFIED", {"metadata": meta, "status": {"observedGeneration": 2}})       # a spec change
    assert needs_pass("MODIFIED", {"metadata": meta})                # no status yet
    assert needs_pass("MODIFIED", {"metadata": meta, "status": "forged"})
    assert needs_pass("MODIFIED", {"metadata": {**meta, "deletionTimestamp": "2026-01-01T00:00:00Z"},
                                   "status": {"observedGeneration": 3}})


def test_a_new_job_s_first_pass_uses_its_event_body_and_later_passes_read_it() -> None:
    kube = FakeKube(job())
    reads: list[str] = []
    real_get = kube.get_job

    def counting_get(namespace: str, name: str) -> Obj | None:
        reads.append(name)
        return real_get(namespace, name)

    real_list = kube.list_pods

    def counting_list(namespace: str, selector: str) -> list[Obj]:
        reads.append("pods")
        return real_list(namespace, selector)

    kube.get_job = counting_get  # type: ignore[method-assign]
    kube.list_pods = counting_list  # type: ignore[method-assign]
    r = Reconciler(kube)  # type: ignore[arg-type]
    try:
        r.trigger(NS, "k", fresh=job())
        # created from the ADDED body (children, 2 identity Secrets, 2 pods): no GET, no pod list
        assert reads == [] and len(kube.creates) == 11
        r.trigger(NS, "k")
        assert reads == ["k", "pods"]
        assert len(kube.creates) == 11                   # nothing twice
    finally:
        r.close()


def test_the_pod_changes_of_a_job_within_the_delay_make_one_pass(monkeypatch: Any) -> None:
    """A job of many pods gets one pass (one pod list) for the pod changes of POD_EVENT_DELAY_S,
    not one each (bench-operator_scale: ~100 back-to-back passes for 512 pods being started)."""
    import time

    from spectrain_operator import builders, handlers

    monkeypatch.setattr(recmod, "POD_EVENT_DELAY_S", 0.3)
    passes: list[str] = []
    r = Reconciler(FakeKube(job()), resync_s=300.0)  # type: ignore[arg-type]
    r.reconcile_once = lambda ns, name: passes.append(name)  # type: ignore[assignment, method-assign, return-value]
    handlers.install(r)
    try:
        t0 = time.monotonic()
        handlers.pod_event(namespace=NS, labels={builders.LABEL_JOB: "k"}, type="ADDED")   # a new pod: nothing
        assert r._timers.pending((NS, "k")) is None
        for _ in range(50):   # 50 pod changes, as the kopf handler sees them
            handlers.pod_event(namespace=NS, labels={builders.LABEL_JOB: "k"}, type="MODIFIED")
        assert passes == [] and 0 < (r._timers.pending((NS, "k")) or 0) <= 0.3
        wait_for(lambda: passes, 10, what="the pass of the pod changes")
        assert time.monotonic() - t0 >= 0.29 and passes == ["k"]
        assert r._timers.pending((NS, "k")) is None   # nothing else to come for them
        r.requeue(NS, "k", 0.2)   # an earlier pending requeue (e.g. a backoff) is kept
        r.pod_changed(NS, "k")
        assert (r._timers.pending((NS, "k")) or 1) <= 0.2
    finally:
        r.close()


def test_a_duration_knob_must_be_a_positive_number_of_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    env_seconds = recmod.env_seconds
    monkeypatch.delenv("SPECTRAIN_POD_EVENT_DELAY_SECONDS", raising=False)
    assert env_seconds("SPECTRAIN_POD_EVENT_DELAY_SECONDS", 0.5) == 0.5
    monkeypatch.setenv("SPECTRAIN_POD_EVENT_DELAY_SECONDS", "0.25")
    assert env_seconds("SPECTRAIN_POD_EVENT_DELAY_SECONDS", 0.5) == 0.25
    for bad in ("half", "0", "-1", "nan"):
        monkeypatch.setenv("SPECTRAIN_POD_EVENT_DELAY_SECONDS", bad)
        with pytest.raises(ValueError, match=r"DELAY_SECONDS=.* must be a positive number of seconds"):
            env_seconds("SPECTRAIN_POD_EVENT_DELAY_SECONDS", 0.5)


def test_a_job_event_with_new_reports_makes_one_batched_pass_and_the_same_reports_none() -> None:
    r = Reconciler(FakeKube(job()))  # type: ignore[arg-type]
    try:
        st = {"observedGeneration": 1, "reports": {"u0": {"pod": "k-0", "progress": '{"step": 1}'}}}
        assert r.reports_changed(NS, "k", st) is True
        assert r.reports_changed(NS, "k", copy.deepcopy(st)) is False     # the operator's own status write
        st["reports"]["u0"]["progress"] = '{"step": 2}'
        assert r.reports_changed(NS, "k", st) is True
        assert r.reports_changed(NS, "k", {"observedGeneration": 1}) is True   # deleted
        assert r.reports_changed(NS, "k", None) is False
    finally:
        r.close()


def test_a_pass_that_raises_is_reported_on_the_job_retried_soon_and_cleared_by_the_next_good_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen with a shipped image missing a module: every pass raised, the job got neither a status
    nor a pod and nothing said so. The failure must show on the job (condition and Warning Event
    ReconcileError), be retried with a growing pause well short of the resync, and clear once a
    pass succeeds."""
    kube = FakeKube(job(target={"image": "img:1", "nodes": 2, "steps": 10, "parallelism": {"data": 2}}))
    events: list[Any] = []
    kube.post_event = lambda j, e: events.append(e)  # type: ignore[method-assign]
    r = Reconciler(kube, resync_s=600.0, retry=Backoff(2.0, 60.0, random.Random(5)))  # type: ignore[arg-type]

    def broken(manifest: Obj, old: Obj | None = None, **kw: Any) -> list[str]:
        raise ModuleNotFoundError("No module named 'celpy'\nsecond line")

    def reconcile_error() -> Obj:
        return {c["type"]: c for c in kube.job["status"]["conditions"]}["ReconcileError"]

    monkeypatch.setattr(recmod.specmod, "validate", broken)
    try:
        r.handle(NS, "k")   # logged, not raised
        cond = reconcile_error()
        assert cond["status"] == "True" and cond["reason"] == "ModuleNotFoundError"
        assert "No module named 'celpy'" in cond["message"] and "second line" not in cond["message"]
        assert [(e.type, e.reason) for e in events] == [("Warning", "ReconcileError")]
        assert "No module named 'celpy'" in events[0].message
        assert 0 < (r._timers.pending((NS, "k")) or 0) <= 2     # soon: a draw in [0, base], not the resync
        assert kube.creates == []
        r._timers.cancel((NS, "k"))
        r.handle(NS, "k")   # the same failure again: the pause grows, no second Event
        assert 0 < (r._timers.pending((NS, "k")) or 0) <= 4
        assert len(events) == 1 and reconcile_error()["status"] == "True"

        monkeypatch.undo()  # the fault removed: the next pass succeeds and clears the condition
        r._timers.cancel((NS, "k"))
        r.handle(NS, "k")
        cond = reconcile_error()
        assert cond["status"] == "False" and cond["reason"] == "Reconciled"
        assert ("Pod", "k-0") in kube.creates and kube.job["status"]["phase"] != "Failed"
        assert 590 < (r._timers.pending((NS, "k")) or 0) <= 600   # back to the resync
        assert [e.reason for e in events].count("ReconcileError") == 1
    finally:
        r.close()
