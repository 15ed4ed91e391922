"""spec.scheduling and Kueue: what scheduling.apply puts on pods, the gang PodGroups, Kueue pod names and release."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest

from spectrain_operator import builders, objects, scheduling
from spectrain_operator import spec as specmod

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
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
    pod["spec"].pop("affinity", None)        # the spread over nodes (test_a_jobs_pods_prefer_different_nodes)
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


def test_kueue_priority_class_label_goes_to_the_pods_with_the_queue() -> None:
    job = make_job()
    job["metadata"]["labels"][scheduling.KUEUE_PRIORITY_LABEL] = "urgent"
    pod = bare_pod()
    scheduling.apply(pod, job)
    # Kueue reads a pod group's WorkloadPriorityClass from the pods, not from the SpecTrainJob
    assert pod["metadata"]["labels"][scheduling.KUEUE_PRIORITY_LABEL] == "urgent"
    del job["metadata"]["labels"][scheduling.KUEUE_QUEUE_LABEL]
    pod = bare_pod()
    scheduling.apply(pod, job)
    assert scheduling.KUEUE_PRIORITY_LABEL not in pod["metadata"]["labels"], "not queued: no Kueue keys at all"


def test_a_kueue_job_alternates_its_pod_names() -> None:
    job = make_job()
    assert [objects.pod_object_name(job, 1, g) for g in range(4)] == ["gpu-dra-1", "gpu-dra-1-r"] * 2
    pod = builders.build_pod(job, 1, generation=3)
    assert pod["metadata"]["name"] == "gpu-dra-1-r"
    assert pod["spec"]["hostname"] == "gpu-dra-1", "peers address the rank by hostname: unchanged"
    del job["metadata"]["labels"][scheduling.KUEUE_QUEUE_LABEL]
    assert builders.build_pod(job, 1, generation=3)["metadata"]["name"] == "gpu-dra-1"


def test_kueue_release_names_the_pods_kueue_still_holds() -> None:
    def pod(name: str, finalizers: list[str], annotations: dict[str, str] | None = None) -> dict:
        return {"metadata": {"name": name, "finalizers": finalizers, "annotations": annotations or {}}}

    held = [scheduling.KUEUE_FINALIZER]
    pods = [pod("a", held), pod("b", []), pod("c", held, {scheduling.KUEUE_RETRIABLE_ANNOTATION: "false"}),
            pod("d", ["other", *held])]
    assert scheduling.kueue_release(pods) == ["a", "d"]
    assert scheduling.kueue_release([]) == []


def test_a_jobs_pods_prefer_different_nodes() -> None:
    """One pod per node: the scheduler is asked to spread a job's pods over nodes (preferred, so a
    cluster with fewer nodes still runs them)."""
    from spectrain_operator import builders
    from spectrain_operator import spec as specmod

    job = specmod.defaulted(specmod.load_manifests(ROOT / "examples" / "demo.yaml")[0])
    p, _ = builders.pod(job, 1)
    (term,) = p["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"labelSelector": {"matchLabels": {"spectrain.io/job-name": "demo"}},
                                       "topologyKey": "kubernetes.io/hostname"}
    job["spec"]["target"]["nodes"] = 1
    job["spec"]["target"]["parallelism"] = {"data": 1, "pipeline": 1, "microbatches": 1}
    p, _ = builders.pod(job, 0)
    assert "affinity" not in p["spec"]
