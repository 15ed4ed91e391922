"""spec.py and the CRD: defaults, structural schema, every CEL rule of API.md (evaluated with celpy
from the CRD's own rule strings) against valid and invalid examples, semantic checks, the CLI."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from spectrain_operator import cli, spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


def base() -> dict[str, Any]:
    return {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "metadata": {"name": "job"},
            "spec": {"target": {"image": "img:1", "checkpoint": {"claimName": "run"}}}}


def with_spec(**paths: Any) -> dict[str, Any]:
    """base() with dotted spec paths set, e.g. with_spec(**{"target.nodes": 2})."""
    m = base()
    for dotted, value in paths.items():
        node = m["spec"]
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return m


# ------------------------------------------------------------------------- the CRD file itself

def _walk(node: dict[str, Any], path: str):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_every_field_has_a_description() -> None:
    missing = [p for p, n in _walk(spec.schema(), "") if not n.get("description")]
    assert missing == [".metadata"]  # the API server forbids anything but name/generateName restrictions there


def test_every_cel_rule_has_a_message_naming_a_field() -> None:
    rules = [r for _, n in _walk(spec.schema(), "") for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 10
    for r in rules:
        assert re.match(r"^(spec|metadata)\.[A-Za-z.]+", r["message"]), r


def test_crd_metadata_printer_columns_and_subresource() -> None:
    crd = spec.crd()
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["stj"] and names["categories"] == ["spectrain"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "Ready", "Drafter", "Harvest", "Restarts", "Age"]


def test_derived_copies_are_identical() -> None:
    src = (ROOT / "crds" / spec.CRD_FILE).read_text()
    assert (ROOT / "operator" / "spectrain_operator" / "data" / spec.CRD_FILE).read_text() == src
    assert (ROOT / "helm" / "spectrain-operator" / "crds" / spec.CRD_FILE).read_text() == src


def test_crd_defaults_equal_the_workload_config_defaults() -> None:
    from spectrain_api import config

    defaulted = config.from_manifest(spec.defaulted(base()))
    plain = config.JobConfig(name="job", target=config.TargetSpec(image="img:1",
                                                                  checkpoint=config.CheckpointSpec(claim_name="run")))
    assert dataclasses.asdict(defaulted) == dataclasses.asdict(plain)


# ------------------------------------------------------------------------- examples

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    assert list(spec.iter_errors([path])) == []


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_fail_naming_their_field(path: Path) -> None:
    expect = re.search(r"^# expect: (\S+)", path.read_text(), re.M)
    assert expect, f"{path.name} must document the field it breaks with a '# expect:' line"
    errors = [e for _, e in spec.iter_errors([path])]
    assert errors, f"{path.name} validated"
    assert any(e.startswith(expect.group(1)) for e in errors), errors


# ------------------------------------------------------------------------- CEL rules

CEL_CASES = [
    # (mutations, expected error prefix or None when valid)
    ({"target.nodes": 2, "target.parallelism": {"data": 1, "pipeline": 2, "microbatches": 2}}, None),
    ({"target.nodes": 2, "target.parallelism": {"data": 1, "pipeline": 1}}, "spec.target.parallelism"),
    ({"target.nodes": 2, "target.procsPerNode": 2, "target.parallelism": {"data": 2, "pipeline": 2,
                                                                          "microbatches": 2}}, None),
    ({"target.nodes": 2, "target.parallelism": {"data": 1, "pipeline": 2, "microbatches": 1}},
     "spec.target.parallelism.microbatches"),
    ({"mode": "RL"}, "spec.target.rl"),
    ({"mode": "RL", "target.rl": {}}, None),
    ({"mode": "Pretrain", "target.rl": {"task": "copy"}}, "spec.target.rl"),
    ({"mode": "AsyncPipeline"}, "spec.target.parallelism.pipeline"),
    ({"mode": "AsyncPipeline", "target.nodes": 2, "target.parallelism": {"pipeline": 2, "microbatches": 2}}, None),
    ({"gpuSharing": {"mode": "DRA"}}, "spec.gpuSharing.gpusPerNode"),
    ({"gpuSharing": {"mode": "None", "gpusPerNode": 1}}, "spec.gpuSharing.gpusPerNode"),
    ({"gpuSharing": {"mode": "PodLocalMPS", "gpusPerNode": 1}}, None),
    ({"gpuSharing": {"mode": "PodLocalMPS", "gpusPerNode": 2}}, "spec.gpuSharing.gpusPerNode"),
    ({"drafter.activation.kinds": ["Bubble", "Bubble"]}, "spec.drafter.activation.kinds"),
    ({"drafter.activation.kinds": []}, "spec.drafter.activation.kinds"),
    ({"drafter.export.path": "a/b/c"}, None),
    ({"drafter.export.path": "a/../b"}, "spec.drafter.export.path"),
    ({"drafter.export.path": "/abs"}, "spec.drafter.export.path"),
    ({"drafter.export.path": "..x/.y/z.."}, None),
    # Pod Security: root, privilege and escalation are refused field by field, naming the fix.
    ({"podSecurityContext": {"runAsUser": 0}}, "spec.podSecurityContext.runAsUser: 0 (root) is refused"),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "spec.podSecurityContext.runAsNonRoot: false is refused"),
    ({"podSecurityContext": {"runAsUser": 2000, "runAsGroup": 0, "fsGroup": 3000, "supplementalGroups": [4],
                             "seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}}, None),
    ({"podSecurityContext": {"seccompProfile": {"type": "Localhost"}}},
     "spec.podSecurityContext.seccompProfile.localhostProfile: required"),
    ({"target.securityContext": {"runAsUser": 0}}, "spec.target.securityContext.runAsUser: 0 (root) is refused"),
    ({"target.securityContext": {"privileged": True}}, "spec.target.securityContext.privileged: true is refused"),
    ({"drafter.securityContext": {"allowPrivilegeEscalation": True}},
     "spec.drafter.securityContext.allowPrivilegeEscalation: true is refused"),
    ({"drafter.securityContext": {"runAsNonRoot": False}}, "spec.drafter.securityContext.runAsNonRoot: false"),
    ({"target.securityContext": {"readOnlyRootFilesystem": True, "privileged": False, "runAsUser": 7,
                                 "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}},
      "drafter.securityContext": {"runAsUser": 7}}, None),
    ({"gpuSharing": {"mode": "PodLocalMPS", "gpusPerNode": 1, "mps": {"runAsUser": 0}}},
     "spec.gpuSharing.mps.runAsUser: 0 (root) is refused"),
    ({"gpuSharing": {"mode": "PodLocalMPS", "gpusPerNode": 1}, "target.securityContext": {"runAsUser": 7}},
     "spec.gpuSharing.mps.runAsUser: PodLocalMPS runs every container as this one UID"),
    ({"gpuSharing": {"mode": "PodLocalMPS", "gpusPerNode": 1, "mps": {"runAsUser": 7}},
      "podSecurityContext": {"runAsUser": 7}, "drafter.securityContext": {"runAsUser": 7}}, None),
    ({"gpuSharing": {"mode": "SingleContainer", "gpusPerNode": 1}, "drafter.securityContext": {"runAsUser": 7}},
     "spec.drafter.securityContext: in gpuSharing mode SingleContainer"),
    ({"gpuSharing": {"mode": "DRA", "gpusPerNode": 1}, "drafter.securityContext": {"runAsUser": 7},
      "target.securityContext": {"runAsUser": 7}}, None),
    # The drafter runs as the target's effective UID: the ring and shared files are the target's, mode 0600.
    ({"drafter.securityContext": {"runAsUser": 7}},
     "spec.drafter.securityContext.runAsUser: the drafter must run as the target's UID"),
    ({"target.securityContext": {"runAsUser": 7}},
     "spec.drafter.securityContext.runAsUser: the drafter must run as the target's UID"),
    ({"podSecurityContext": {"runAsUser": 7}, "drafter.securityContext": {"runAsUser": 1000}},
     "spec.drafter.securityContext.runAsUser: the drafter must run as the target's UID"),
    ({"drafter.securityContext": {"runAsUser": 1000}}, None),
    ({"podSecurityContext": {"runAsUser": 7}, "drafter.securityContext": {"runAsUser": 7}}, None),
    ({"podSecurityContext": {"runAsUser": 7}, "target.securityContext": {"runAsUser": 8},
      "drafter.securityContext": {"runAsUser": 8}}, None),
    ({"gpuSharing": {"mode": "SingleContainer", "gpusPerNode": 1}, "target.securityContext": {"runAsUser": 7}}, None),
    ({"networkPolicy": {"enabled": False}}, None),
    ({"networkPolicy": {"metricsFrom": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]}}},
     None),
]


@pytest.mark.parametrize("mutations,expected", CEL_CASES)
def test_rules(mutations: dict[str, Any], expected: str | None) -> None:
    errors = spec.validate(with_spec(**mutations))
    if expected is None:
        assert errors == []
    else:
        assert errors and all(e.startswith(expected) for e in errors), errors


def test_cel_rules_alone_catch_what_they_own() -> None:
    """The CEL layer (what a 1.25+ API server runs) rejects these even when called directly."""
    def cel(**m: Any) -> list[str]:
        return spec.cel_errors(spec.apply_defaults(with_spec(**m)))
    assert cel(**{"target.nodes": 3})[0].startswith("spec.target.parallelism")
    assert cel(**{"drafter.activation.kinds": ["Bubble", "Bubble"]})[0].startswith("spec.drafter.activation.kinds")
    assert cel(**{"drafter.export.path": "../x"})[0].startswith("spec.drafter.export.path")
    long = base()
    long["metadata"]["name"] = "a" * 53
    assert spec.cel_errors(spec.apply_defaults(long))[0].startswith("metadata.name")
    assert cel() == []


def test_name_length_limit_is_the_longest_child_suffix() -> None:
    ok, bad = base(), base()
    ok["metadata"]["name"] = "a" * 52
    bad["metadata"]["name"] = "a" * 53
    assert spec.validate(ok) == []
    assert spec.validate(bad)[0].startswith("metadata.name")
    unicode = base()
    unicode["metadata"]["name"] = "jöb"
    assert spec.validate(unicode)[0].startswith("metadata.name")


def test_target_and_drafter_are_immutable_but_suspend_run_policy_scheduling_are_not() -> None:
    old = with_spec(**{"target.steps": 10})
    assert spec.validate(with_spec(**{"target.steps": 11}), old=old)[0].startswith("spec.target is immutable")
    assert spec.validate(with_spec(**{"target.steps": 10, "drafter.enabled": False}), old=old)[0].startswith(
        "spec.drafter is immutable")
    changed = with_spec(**{"target.steps": 10, "suspend": True, "runPolicy": {"maxRestarts": 9},
                           "scheduling": {"priorityClassName": "high"}})
    assert spec.validate(changed, old=old) == []


# ------------------------------------------------------------------------- schema and semantics

def test_the_network_policy_is_immutable_the_pod_security_context_is_not() -> None:
    old = with_spec(**{"target.steps": 10})
    np = with_spec(**{"target.steps": 10, "networkPolicy": {"enabled": False}})
    assert spec.validate(np, old=old)[0].startswith("spec.networkPolicy is immutable")
    assert spec.validate(with_spec(**{"target.steps": 10, "podSecurityContext": {"runAsUser": 5}}), old=old) == []


@pytest.mark.parametrize("mutations,expected", [
    ({"target.securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}},
     "spec.target.securityContext.capabilities.add[0]: 'SYS_ADMIN' is not one of: NET_BIND_SERVICE"),
    ({"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}},
     "spec.podSecurityContext.seccompProfile.type: 'Unconfined' is not one of"),
    ({"podSecurityContext": {"sysctls": []}}, "spec.podSecurityContext.sysctls: unknown field"),
    ({"target.nodes": "2"}, "spec.target.nodes: must be an integer"),
    ({"target.nodes": 2.0}, "spec.target.nodes: must be an integer"),
    ({"target.nodes": 10**30}, "spec.target.nodes: must be <="),
    ({"target.steps": 0}, "spec.target.steps: must be >= 1"),
    ({"target.optimizer.lr": 0}, "spec.target.optimizer.lr: must be > 0"),
    ({"target.parallelism.schedule": "ZB"}, "spec.target.parallelism.schedule: 'ZB' is not one of"),
    ({"target.typo": 1}, "spec.target.typo: unknown field"),
    ({"drafter.gpuShare.pinnedMemoryLimit": "lots"}, "spec.drafter.gpuShare.pinnedMemoryLimit"),
    ({"drafter.gpuShare.activeThreadPercentage": 101}, "spec.drafter.gpuShare.activeThreadPercentage"),
    ({"runPolicy.failurePolicy.rules": [{"action": "FailJob", "onExitCodes": {"values": [256]}}]},
     "spec.runPolicy.failurePolicy.rules[0].onExitCodes.values[0]: must be <= 255"),
    ({"runPolicy.failurePolicy.rules": [{"action": "Explode", "onExitCodes": {"values": [1]}}]},
     "spec.runPolicy.failurePolicy.rules[0].action"),
    ({"target.data.source": "http://x"}, "spec.target.data.source"),
    ({"target.model.preset": "13b"}, "spec.target.model.preset"),
])
def test_schema_errors_name_the_field(mutations: dict[str, Any], expected: str) -> None:
    errors = spec.validate(with_spec(**mutations))
    assert any(e.startswith(expected) for e in errors), errors


def test_missing_sections_and_wrong_documents() -> None:
    assert spec.validate({"apiVersion": "v1", "kind": "Pod"})[:2] == [
        "apiVersion: must be spectrain.io/v1alpha1 (got 'v1')", "kind: must be SpecTrainJob (got 'Pod')"]
    no_target = base()
    del no_target["spec"]["target"]
    assert spec.validate(no_target) == ["spec.target: required"]
    assert spec.validate(["not", "a", "mapping"])[0].startswith("(document)")


def test_nullable_fields_and_pruned_nulls() -> None:
    m = with_spec(**{"runPolicy": {"activeDeadlineSeconds": None, "ttlSecondsAfterFinished": None},
                     "drafter.image": None})
    assert spec.validate(m) == []
    d = spec.defaulted(m)
    assert d["spec"]["runPolicy"]["activeDeadlineSeconds"] is None
    assert "image" not in d["spec"]["drafter"]  # null pruned (empty means target.image)


def test_semantic_layers_divisible_by_pipeline() -> None:
    m = with_spec(**{"target.nodes": 3, "target.parallelism": {"pipeline": 3, "microbatches": 3},
                     "target.data.batchSize": 6})
    errors = spec.validate(m)
    assert errors == ["spec.target.parallelism.pipeline: 3 stages do not divide the model's 4 layers (preset debug); "
                      "choose a divisor of 4 or set spec.target.model.overrides.n_layers"]
    m["spec"]["target"]["model"] = {"preset": "debug", "overrides": {"n_layers": 6}}
    assert spec.validate(m) == []
    m["spec"]["target"]["model"]["overrides"]["n_layers"] = "six"
    assert spec.validate(m)[0].startswith("spec.target.model.overrides.n_layers")


def test_semantic_interleaved_needs_chunks_of_layers_and_groups_of_microbatches() -> None:
    par = {"pipeline": 2, "microbatches": 4, "schedule": "Interleaved1F1B"}
    assert spec.validate(with_spec(**{"target.nodes": 2, "target.parallelism": par})) == []
    errors = spec.validate(with_spec(**{"target.nodes": 2, "target.parallelism": {**par, "microbatches": 3},
                                        "target.data.batchSize": 6}))
    assert errors == ["spec.target.parallelism.microbatches: Interleaved1F1B needs a multiple of pipeline (2), got 3"]
    errors = spec.validate(with_spec(**{"target.parallelism": {**par, "pipeline": 1}}))
    assert errors and errors[0].startswith("spec.target.parallelism.pipeline: Interleaved1F1B")
    errors = spec.validate(with_spec(**{"target.nodes": 4, "target.parallelism": {**par, "pipeline": 4}}))
    assert errors and errors[0].startswith("spec.target.parallelism.schedule: Interleaved1F1B gives each of the 4 "
                                           "pipeline ranks 2 model chunks")


def test_semantic_seq_len_within_the_model() -> None:
    errors = spec.validate(with_spec(**{"target.data.seqLen": 4096}))
    assert errors[0].startswith("spec.target.data.seqLen: 4096 exceeds")


def test_defaulted_raises_with_every_error() -> None:
    with pytest.raises(spec.SpecError) as exc:
        spec.defaulted(with_spec(**{"target.nodes": 0, "target.steps": 0}))
    assert len(exc.value.errors) == 2


def test_defaults_do_not_touch_the_input() -> None:
    m = base()
    before = copy.deepcopy(m)
    spec.apply_defaults(m)
    assert m == before


# ------------------------------------------------------------------------- CLI

def test_cli_validate_exit_codes_and_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", *map(str, EXAMPLES)]) == 0
    capsys.readouterr()
    assert cli.main(["validate", str(EXAMPLES[0]), *map(str, INVALID)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) >= len(INVALID)
    for line in lines:
        where, _, error = line.partition(": ")
        assert where.endswith(".yaml") and re.match(r"^(spec|metadata)\.", error), line


def test_cli_validate_multi_document_and_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "two.yaml"
    bad = with_spec(**{"target.nodes": 0})
    f.write_text(yaml.safe_dump_all([base(), bad]))
    assert cli.main(["validate", str(f), str(tmp_path / "missing.yaml")]) == 1
    out = capsys.readouterr().out
    assert f"{f}#1: spec.target.nodes: must be >= 1 (got 0)" in out
    assert "missing.yaml: (file): cannot read" in out


def test_cli_render_is_what_the_builders_produce(capsys: pytest.CaptureFixture[str]) -> None:
    from spectrain_operator import builders

    demo = ROOT / "examples" / "demo.yaml"
    assert cli.main(["render", str(demo)]) == 0
    rendered = list(yaml.safe_load_all(capsys.readouterr().out))
    expected = builders.render(spec.defaulted(spec.load_manifests(demo)[0]))
    assert rendered == expected
    assert all("ownerReferences" not in o["metadata"] for o in rendered)
    assert cli.main(["render", str(INVALID[0])]) == 1


# ------------------------------------------------------------------------- shared run volume

@pytest.mark.parametrize(("nodes", "procs", "pipeline", "claim", "drafter", "refused"), [
    (2, 1, 2, "", True, True),            # one stage per pod: neither pod has both parts
    (2, 1, 2, "run", True, False),        # a claim every pod mounts
    (2, 1, 2, "", False, False),          # no drafter, nothing to read
    (2, 2, 2, "", True, False),           # whole pipelines inside each pod
    (2, 4, 2, "", True, False),
    (4, 3, 2, "", True, False),           # stages (0,1,0) (1,0,1) ...: every pod has 0 and 1
    (2, 2, 4, "", True, True),            # stages (0,1) and (2,3)
    (1, 1, 1, "", True, False),
])
def test_a_pipeline_across_pods_needs_a_shared_run_volume(nodes: int, procs: int, pipeline: int, claim: str,
                                                         drafter: bool, refused: bool) -> None:
    from spectrain_api.config import JobConfig, Parallelism
    from spectrain_api.rules import shared_volume_errors

    cfg = JobConfig()
    cfg.target.nodes, cfg.target.procs_per_node = nodes, procs
    cfg.target.parallelism = Parallelism(data=nodes * procs // pipeline, pipeline=pipeline, microbatches=pipeline)
    cfg.target.checkpoint.claim_name = claim
    cfg.drafter.enabled = drafter
    errors = shared_volume_errors(cfg)
    assert bool(errors) == refused, errors
    if refused:
        assert errors[0].startswith("spec.target.checkpoint.claimName: required") and "procsPerNode" in errors[0]
