"""Hostile input against the real apiserver and the running operator: 50+ malformed objects (wrong
types, huge numbers, missing sections, unicode names, unknown fields, status written by a user).
Each is either rejected at apply time (what the 1.20 schema enforces) or accepted and then given a
clear condition by the operator; the operator never crashes. The CRD's CEL rules are enforced by a
server that evaluates them (>= 1.25: rejected at apply time, as `spectrain validate` predicts); on
1.20, which has no CEL, the operator enforces them itself as SpecInvalid."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from spectrain_operator import spec as specmod
from tests.integration.operator_harness import GROUP, PLURAL, VERSION, Env, env_fixture  # noqa: F401  (the env fixture)
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

GOOD: dict[str, Any] = {"target": {"image": "img:1", "nodes": 1, "steps": 5}, "runPolicy": {"backoffSeconds": 1}}


def mutate(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(GOOD)
    node = spec
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return spec


_DELETE = object()

# (spec, whether the 1.20 schema must reject it at apply time)
SPECS: list[tuple[dict[str, Any], bool]] = [
    (mutate("target.nodes", "two"), True),
    (mutate("target.nodes", 2.5), True),
    (mutate("target.nodes", 10**18), True),
    (mutate("target.nodes", -1), True),
    (mutate("target.nodes", None), False),  # null pruned, then defaulted
    (mutate("target.steps", 10**30), True),
    (mutate("target.steps", True), True),
    (mutate("target.image", _DELETE), True),
    (mutate("target.image", ""), True),
    (mutate("target.image", 42), True),
    (mutate("target.image", "x" * 5000), True),
    (mutate("target", _DELETE), True),
    (mutate("target", []), True),
    (mutate("target", "target"), True),
    (mutate("mode", "Finetune"), True),
    (mutate("mode", "rl"), True),
    (mutate("target.parallelism", {"data": 0}), True),
    (mutate("target.parallelism", {"schedule": "ZeroBubble"}), True),
    (mutate("target.optimizer", {"lr": 0}), True),
    (mutate("target.optimizer", {"lr": -1e300}), True),
    (mutate("target.optimizer", {"name": "SGD"}), True),
    (mutate("target.data", {"seqLen": 4}), True),
    (mutate("target.data", {"source": "s3://bucket"}), True),
    (mutate("target.data", {"source": "pvc://UPPER/x"}), True),
    (mutate("target.model", {"preset": "70b"}), True),
    (mutate("target.env", [{"value": "no-name"}]), True),
    (mutate("target.env", "FOO=1"), True),
    (mutate("target.resources", {"limits": {"cpu": "lots"}}), True),
    (mutate("target.checkpoint", {"keep": 0}), True),
    (mutate("drafter", {"activation": {"kinds": []}}), True),
    (mutate("drafter", {"activation": {"kinds": ["Bubble", "Bubble"]}}), True),
    (mutate("drafter", {"activation": {"kinds": ["Coffee"]}}), True),
    (mutate("drafter", {"activation": {"policy": "Sometimes"}}), True),
    (mutate("drafter", {"gpuShare": {"activeThreadPercentage": 0}}), True),
    (mutate("drafter", {"gpuShare": {"activeThreadPercentage": 1000}}), True),
    (mutate("drafter", {"gpuShare": {"pinnedMemoryLimit": "8 gigs"}}), True),
    (mutate("drafter", {"export": {"path": "../../../etc/passwd"}}), True),
    (mutate("drafter", {"export": {"path": "/abs"}}), True),
    (mutate("drafter", {"maxFailures": -3}), True),
    (mutate("drafter", "on"), True),
    (mutate("gpuSharing", {"mode": "MIG"}), True),
    (mutate("gpuSharing", {"gpusPerNode": 1000}), True),
    (mutate("ring", {"sizeLimit": "huge"}), True),
    (mutate("runPolicy", {"maxRestarts": -1}), True),
    (mutate("runPolicy", {"activeDeadlineSeconds": 0}), True),
    (mutate("runPolicy", {"failurePolicy": {"rules": [{"action": "Panic", "onExitCodes": {"values": [1]}}]}}), True),
    (mutate("runPolicy", {"failurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"values": []}}]}}), True),
    (mutate("runPolicy", {"failurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {"values": [999]}}]}}), True),
    (mutate("scheduling", {"gang": {"provider": "Kueue"}}), True),
    (mutate("scheduling", {"tolerations": [{"operator": "Maybe"}]}), True),
    # accepted by the 1.20 schema, refused by the operator (CEL rules / semantics): Failed + SpecInvalid
    (mutate("target.nodes", 3), False),
    (mutate("mode", "RL"), False),
    (mutate("mode", "AsyncPipeline"), False),
    (mutate("gpuSharing", {"mode": "DRA"}), False),
    (mutate("gpuSharing", {"mode": "None", "gpusPerNode": 1}), False),
    (mutate("target.parallelism", {"pipeline": 3}), False),
    (mutate("target.data", {"seqLen": 100000}), False),
    # accepted and fine: unknown fields are pruned by the API server
    (mutate("target.surprise", {"nested": ["x"]}), False),
    (mutate("target.model", {"overrides": {"n_layers": "many", "weird": [1, {"a": None}]}}), False),
]


def _name(i: int) -> str:
    return f"fz-{i}"


def test_malformed_objects_are_rejected_or_get_a_clear_condition(env: Env) -> None:
    assert len(SPECS) >= 50
    accepted: list[str] = []
    for i, (spec, must_reject) in enumerate(SPECS):
        manifest = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SpecTrainJob",
                    "metadata": {"name": _name(i), "namespace": env.ns}, "spec": spec}
        if not must_reject and env.kube.enforces_cel:
            must_reject = bool(specmod.cel_errors(specmod.apply_defaults(manifest)))
        try:
            env.create(manifest)
        except ApiException as exc:
            assert exc.status == 422, (i, spec, exc.status, exc.body)
            assert must_reject, f"#{i} rejected but the schema (and CEL) should accept it: {spec}: {exc.body[:300]}"
            continue
        assert not must_reject, f"#{i} accepted but must be rejected at apply time: {spec}"
        accepted.append(_name(i))

    def settled(name: str) -> bool:
        env.operator.check_alive()
        conds = {c["type"]: c for c in env.status(name).get("conditions") or []}
        return "SpecInvalid" in conds or "Created" in conds
    for name in accepted:
        wait_for(lambda n=name: settled(n), 30, interval=0.1, what=f"a condition on {name}")
        st = env.status(name)
        conds = {c["type"]: c for c in st["conditions"]}
        if "SpecInvalid" in conds:
            assert st["phase"] == "Failed" and conds["SpecInvalid"]["message"].split(":")[0].startswith("spec.")
            assert env.pods(name) == []
        else:
            assert st["phase"] in ("Pending", "Starting", "Running")
    env.operator.check_alive()


@pytest.mark.parametrize("name", ["ünïcode", "UPPER", "-leading", "a" * 64, "with.dot", "x" * 53])
def test_hostile_names_are_rejected(env: Env, name: str) -> None:
    manifest = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SpecTrainJob",
                "metadata": {"name": name, "namespace": env.ns}, "spec": GOOD}
    with pytest.raises(ApiException) as exc:
        env.create(manifest)
    assert exc.value.status in (400, 422)


STATUSES: list[dict[str, Any]] = [
    {"phase": "Succeeded"},
    {"phase": "Running", "restarts": 10**9, "restartGeneration": 7, "podsCreated": True},
    {"conditions": [{"type": "Failed", "status": "True", "reason": "Forged", "message": "user wrote this"}]},
    {"restartAt": "2999-01-01T00:00:00Z", "phase": "Restarting"},
    {"drafter": {"state": "Active", "activeRanks": 99, "harvestEfficiency": -5.0}, "progress": {"step": -1}},
    {"startTime": "1970-01-01T00:00:00Z", "phase": "Running"},
]


@pytest.mark.parametrize("idx", range(len(STATUSES)))
def test_status_written_by_a_user_never_crashes_the_operator(env: Env, idx: int) -> None:
    name = f"us-{idx}"
    env.create({"apiVersion": f"{GROUP}/{VERSION}", "kind": "SpecTrainJob",
                "metadata": {"name": name, "namespace": env.ns}, "spec": GOOD})
    wait_for(lambda: env.status(name).get("phase"), 30, interval=0.1, what=f"{name} first status")
    try:
        env.custom.patch_namespaced_custom_object_status(GROUP, VERSION, env.ns, PLURAL, name,
                                                         {"status": STATUSES[idx]})
    except ApiException as exc:  # the schema refused the forged status: nothing reached the operator
        assert exc.status == 422, exc.body
    # whatever the operator makes of it, it keeps running and the job keeps a phase and conditions
    env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name,
                                              {"metadata": {"labels": {"poke": "1"}}})
    wait_for(lambda: env.status(name).get("observedGeneration") is not None, 30, what=f"{name} reconciled")
    env.operator.check_alive()
    st = env.status(name)
    assert st.get("phase") in ("Pending", "Starting", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
    assert st.get("conditions")
    json.dumps(st)
