"""spectrain_api.fleet_identity: every malformed peers document or identity file is refused with an
error naming what is wrong, and a document of another job or generation is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectrain_api import fleet_identity as fi
from spectrain_api.errors import ConfigError

pytestmark = pytest.mark.unit
KEY = "ab" * fi.KEY_BYTES


def _doc(**over: object) -> str:
    return json.dumps({"jobUID": "u", "generation": 1, "localWorldSize": 2, "publicKeys": [KEY, KEY], **over})


@pytest.mark.parametrize(("over", "names"), [
    ({"jobUID": ""}, "jobUID"), ({"generation": -1}, "generation"), ({"generation": True}, "generation"),
    ({"localWorldSize": 0}, "localWorldSize"), ({"publicKeys": []}, "publicKeys"),
    ({"publicKeys": [KEY, "AB" * fi.KEY_BYTES]}, "publicKeys[1]"), ({"publicKeys": [KEY[:-2]]}, "publicKeys[0]"),
])
def test_a_malformed_peers_document_names_the_field(over: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        fi.parse_peers(_doc(**over), "peers.json")


def test_not_json_or_not_an_object_is_refused() -> None:
    with pytest.raises(ConfigError, match="not JSON"):
        fi.parse_peers("{", "peers.json")
    with pytest.raises(ConfigError, match="JSON object"):
        fi.parse_peers("[]", "peers.json")


def test_another_jobs_or_generations_document_is_refused(tmp_path: Path) -> None:
    p = tmp_path / fi.PEERS_ITEM
    p.write_text(_doc())
    assert fi.load_peers(p, "u", 1).public_key(3) == bytes.fromhex(KEY)
    assert fi.load_peers(p, "u", 1).public_key(4) is None          # a rank of no pod
    with pytest.raises(ConfigError, match="belongs to job 'v'"):
        fi.load_peers(p, "v", 1)
    with pytest.raises(ConfigError, match="restart generation 1, this pod's is 2"):
        fi.load_peers(p, "u", 2)
    with pytest.raises(ConfigError, match="SPECTRAIN_FLEET_PEERS_FILE is not set"):
        fi.load_peers(None, "u", 1)


def test_an_identity_file_must_be_private_and_hold_a_key(tmp_path: Path) -> None:
    p = tmp_path / fi.IDENTITY_ITEM
    p.write_text(KEY)
    p.chmod(0o644)
    with pytest.raises(ConfigError, match="every user of the machine can read it"):
        fi.load_identity(p)
    p.chmod(0o600)
    assert fi.load_identity(p) == bytes.fromhex(KEY)
    p.write_text("zz")
    with pytest.raises(ConfigError, match="SPECTRAIN_FLEET_IDENTITY_FILE.*64 hex characters"):
        fi.load_identity(p)
    with pytest.raises(ConfigError, match="SPECTRAIN_FLEET_IDENTITY_FILE is not set"):
        fi.load_identity(None)
