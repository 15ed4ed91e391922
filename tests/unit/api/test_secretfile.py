"""secretfile.require_private (and the fleet key's `load_key`) on real files with real modes and
owners: the check runs as a pod's user would (effective uid 1000, gid 1000, the fsGroup 2000 as a
supplementary group, as a kubelet starts it), so the kubelet's Secret under fsGroup (0440 root:2000)
is exercised exactly; the files are chown'ed and chmod'ed as root."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from spectrain_api.errors import ConfigError
from spectrain_api.secretfile import require_private
from spectrain_workloads.drafter.auth import load_key

UID, GID, FS_GROUP, OTHER_GROUP = 1000, 1000, 2000, 3000
KEY_HEX = "ab" * 32

# name -> (mode, owner uid, group gid, refused?, what the refusal names)
CASES = {
    "secret-under-fsgroup": (0o440, 0, FS_GROUP, False, ""),
    "own-0400": (0o400, UID, GID, False, ""),
    "own-0600": (0o600, UID, GID, False, ""),
    "world-readable": (0o444, 0, FS_GROUP, True, "o+r"),
    "own-0644": (0o644, UID, GID, True, "o+r"),
    "group-writable": (0o460, 0, FS_GROUP, True, "g+w"),
    "other-group": (0o440, 0, OTHER_GROUP, True, "not in that group"),
    "other-owner": (0o400, 1001, GID, True, "owned by uid 1001"),
}

@contextmanager
def as_pod_user() -> Iterator[None]:
    """This process as a pod's user (uid 1000, gid 1000, supplementary group the fsGroup) until the
    block ends: effective ids only, so root takes them back after."""
    groups = os.getgroups()
    os.setgroups([FS_GROUP])
    os.setegid(GID)
    os.seteuid(UID)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def _verdict(path: Path) -> str:
    try:
        return "ok" if load_key(path) == bytes.fromhex(KEY_HEX) else "wrong key"
    except ConfigError as exc:
        return f"refused: {exc}"


@pytest.fixture(name="keys")
def keys_fixture() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:      # under /tmp, which the pod's user can traverse
        root = Path(d)
        root.chmod(0o755)
        for name, (mode, uid, gid, _, _) in CASES.items():
            p = root / name
            p.write_text(KEY_HEX + "\n")
            os.chown(p, uid, gid)
            os.chmod(p, mode)
        yield root


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to other users needs root (the test machine runs as root)")
def test_a_pod_user_reads_its_secret_and_refuses_every_other_key_file(keys: Path) -> None:
    with as_pod_user():
        got = {name: _verdict(keys / name) for name in CASES}
    for name, (mode, uid, gid, refused, why) in CASES.items():
        verdict = got[name]
        if not refused:
            assert verdict == "ok", (name, verdict)
            continue
        assert verdict.startswith("refused: "), (name, verdict)
        # the message names the file, its mode and owner, what is wrong, and the fix
        for part in (str(keys / name), f"mode {mode:04o}", f"owner uid {uid}", f"group gid {gid}", why, "chmod 0400"):
            assert part in verdict, (name, part, verdict)


def test_the_local_backend_s_key_mode_passes_and_a_umask_default_does_not(tmp_path: Path) -> None:
    from spectrain_operator.local_layout import run_identity

    run_identity(tmp_path)                          # `spectrain run`'s fleet/key: 0600, this user's
    assert len(load_key(tmp_path / "fleet" / "key")) == 32
    assert (tmp_path / "fleet" / "key").stat().st_mode & 0o777 == 0o600
    p = tmp_path / "plain"
    p.write_text(KEY_HEX)
    p.chmod(0o644)                                   # what write_text leaves under umask 022
    with pytest.raises(ConfigError, match=r"'.*plain' \(mode 0644.*refused: every user of the machine can read it"):
        load_key(p)
    require_private(tmp_path / "missing", "x")       # a missing file: left to the reader's own error
