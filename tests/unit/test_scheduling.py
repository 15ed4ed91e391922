"""spec.scheduling and Kueue: what scheduling.apply puts on pods, the gang PodGroups, merge_admitted."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest

from spectrain_operator import builders, scheduling
from spectrain_operator import spec as specmod

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GPU_TOL = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def make_job(**scheduling_spec: object) -> dict:
    job = specmod.load_manifests(ROOT / "examples" / "gpu-dra.yaml")[0]
    job["metadata"]["namespace"] = "team-a"
    job["metadata"]["uid"] = "0c1d2e3f-0000-4000-8000-000000000002"
    job["spec"]["scheduling"] = scheduling_spec
    assert specmod.validate(job) == []
    return specmod.apply_defaults(job)


def bare_pod() -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"a": "b"}},
            "spec": {"containers": [{"name": "target", "image": "img"}],
                     "nodeSelector": {"existing": "yes"}, "tolerations": [dict(GPU_TOL)]}}


def test_fields_are_copied_and_merged() -> None:
    job = make_job(schedulerName="my-scheduler", priorityClassName="training",
                   nodeSelector={"gpu": "h200", "existing": "override"},
                   tolerations=[GPU_TOL, {"key": "dedicated", "operator": "Equal", "value": "ml",
                                          "effect": "NoSchedule"}])
    pod = bare_pod()
    assert scheduling.apply(pod, job) == []
    spec = pod["spec"]
    assert spec["schedulerName"] == "my-scheduler"
    assert spec["priorityClassName"] == "training"
    assert spec["nodeSelector"] == {"existing": "override", "gpu": "h200"}
    assert spec["tolerations"] == [GPU_TOL, {"key": "dedicated", "operator": "Equal", "value": "ml",
                                             "effect": "NoSchedule"}], "no duplicates, order kept"


def test_empty_scheduling_changes_nothing_but_kueue() -> None:
    job = make_job()
    del job["metadata"]["labels"]
    pod = bare_pod()
    before = copy.deepcopy(pod)
    assert scheduling.apply(pod, job) == []
    assert pod == before


def test_kueue_queue_label_and_pod_group_keys() -> None:
    job = make_job()
    pod = bare_pod()
    scheduling.apply(pod, job)
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels[scheduling.KUEUE_QUEUE_LABEL] == "team-a"
    assert labels[scheduling.KUEUE_GROUP_LABEL] == "gpu-dra"
    assert annotations[scheduling.KUEUE_GROUP_COUNT_ANNOTATION] == "2"
    assert labels["a"] == "b"


def test_scheduler_plugins_gang() -> None:
    job = make_job(gang={"provider": "SchedulerPlugins"}, schedulerName="scheduler-plugins-scheduler")
    pod = bare_pod()
    (group,) = scheduling.apply(pod, job)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == "gpu-dra"
    assert group["metadata"]["namespace"] == "team-a"
    assert group["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert group["spec"] == {"minMember": 2}
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "gpu-dra"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"


def test_volcano_gang() -> None:
    job = make_job(gang={"provider": "Volcano"}, priorityClassName="training")
    pod = bare_pod()
    (group,) = scheduling.apply(pod, job)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {"minMember": 2, "priorityClassName": "training"}
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gpu-dra"
    assert pod["spec"]["schedulerName"] == "volcano"


def test_volcano_with_another_scheduler_names_the_field() -> None:
    job = make_job(gang={"provider": "Volcano"}, schedulerName="default-scheduler")
    with pytest.raises(scheduling.SchedulingError, match=r"spec\.scheduling\.schedulerName"):
        scheduling.apply(bare_pod(), job)


def test_unknown_gang_provider_names_the_field() -> None:
    job = make_job()
    job["spec"]["scheduling"]["gang"] = {"provider": "Yunikorn"}
    with pytest.raises(scheduling.SchedulingError, match=r"spec\.scheduling\.gang\.provider"):
        scheduling.apply(bare_pod(), job)


def test_builder_pods_validate_with_every_provider() -> None:
    for provider in scheduling.GANG_PROVIDERS:
        job = make_job(gang={"provider": provider}, nodeSelector={"gpu": "h200"}, tolerations=[GPU_TOL])
        pods, extras = builders.pods(job)
        assert len(pods) == 2
        assert len(extras) == (1 if provider == "None" else 2)  # + the DRA claim template
        for pod in pods:
            kubernetes_validate.validate(pod, "1.34.0", strict=True)
            assert pod["spec"]["nodeSelector"] == {"gpu": "h200"}


def test_merge_admitted_keeps_what_kueue_added() -> None:
    job = make_job(nodeSelector={"gpu": "h200"}, tolerations=[GPU_TOL])
    built, _ = builders.pod(job, 0)
    existing = copy.deepcopy(built)
    existing["spec"]["nodeSelector"] = {"gpu": "a100", "cloud.example.com/flavor": "spot"}
    existing["spec"]["tolerations"] = [
        GPU_TOL,
        {"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 300},
    ]
    existing["spec"]["schedulingGates"] = [{"name": scheduling.KUEUE_SCHEDULING_GATE}]
    existing["spec"]["nodeName"] = "node-7"
    original = copy.deepcopy(built)
    merged = scheduling.merge_admitted(built, existing)
    assert built == original, "the input pod is not mutated"
    assert merged["spec"]["nodeSelector"] == {"gpu": "h200", "cloud.example.com/flavor": "spot"}
    assert merged["spec"]["tolerations"] == [GPU_TOL, {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert "schedulingGates" not in merged["spec"]
    assert "nodeName" not in merged["spec"]
    kubernetes_validate.validate(merged, "1.34.0", strict=True)


def test_merge_admitted_with_nothing_added_is_identity() -> None:
    built, _ = builders.pod(make_job(), 0)
    assert scheduling.merge_admitted(built, copy.deepcopy(built)) == built
