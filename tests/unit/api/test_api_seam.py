"""spectrain_api's wire pieces: the supervisor verdict both sides read, and the one parser of the
volume URIs the operator mounts and the workloads open."""

from __future__ import annotations

import json

import pytest

from spectrain_api import volumes
from spectrain_api.errors import ConfigError
from spectrain_api.names import SUPERVISOR_VERDICT_KEY
from spectrain_api.verdict import MAX_TARGET_MESSAGE_CHARS, SupervisorVerdict

pytestmark = pytest.mark.unit


def test_a_verdict_round_trips_through_its_wire_shape() -> None:
    v = SupervisorVerdict("mps-by-drafter", 86, 3, True, 139, None, "CUDA error: x")
    wire = json.loads(v.to_json())
    assert set(wire) == {SUPERVISOR_VERDICT_KEY}
    assert wire[SUPERVISOR_VERDICT_KEY]["lastDrafterExitCode"] == 139
    assert SupervisorVerdict.from_json(v.to_json()) == v


@pytest.mark.parametrize("message", [None, "", "configuration error: spec.mode ...", "[1, 2]", '{"other": {}}',
                                     json.dumps({SUPERVISOR_VERDICT_KEY: "target"})])
def test_a_message_that_is_not_a_verdict_reads_as_none(message: str | None) -> None:
    assert SupervisorVerdict.from_json(message) is None


def test_fields_of_the_wrong_type_read_as_absent() -> None:
    raw = {SUPERVISOR_VERDICT_KEY: {"cause": "bogus", "targetExitCode": "3", "drafterFailures": True,
                                    "drafterDisabled": "yes", "mpsExitCode": 1.5,
                                    "targetMessage": "x" * (MAX_TARGET_MESSAGE_CHARS + 10)}}
    v = SupervisorVerdict.from_json(json.dumps(raw))
    assert v is not None
    assert (v.cause, v.target_exit_code, v.drafter_failures, v.drafter_disabled, v.mps_exit_code) == (
        "target", None, 0, False, None)
    assert v.target_message is not None and len(v.target_message) == MAX_TARGET_MESSAGE_CHARS


@pytest.mark.parametrize(("uri", "scheme", "claim", "local"), [
    ("file:///data/corpus", "file", None, "/data/corpus"),
    ("pvc://corpus/py/src", "pvc", "corpus", "/mnt/d/corpus/py/src"),
    ("pvc://corpus", "pvc", "corpus", "/mnt/d/corpus"),
    ("pvc:///corpus/x/", "pvc", "corpus", "/mnt/d/corpus/x"),
])
def test_volume_uris_parse_to_a_claim_and_a_local_path(uri: str, scheme: str, claim: str | None, local: str) -> None:
    ref = volumes.parse("spec.x", uri)
    assert (ref.scheme, ref.claim, str(ref.local_path("/mnt/d"))) == (scheme, claim, local)
    assert volumes.claim_of(uri) == claim and volumes.errors("spec.x", uri) == []


@pytest.mark.parametrize(("uri", "says"), [
    ("file://relative/dir", "file:// needs an absolute path"),
    ("pvc://", "use pvc://<claim>/<path>"),
    ("Qwen/Qwen3-8B", "hub id is not fetched at run time"),
    ("s3://bucket/x", "use file:///abs/dir or pvc://<claim>/<path>"),
    ("", "must be file:///abs/dir or pvc://<claim>/<path>"),
])
def test_a_bad_volume_uri_is_refused_naming_the_field_and_the_forms(uri: str, says: str) -> None:
    with pytest.raises(ConfigError, match="spec.target.model.path") as exc:
        volumes.parse("spec.target.model.path", uri)
    assert says in str(exc.value)
    assert volumes.claim_of(uri) is None
