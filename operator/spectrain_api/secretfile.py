"""Who may read a secret file (the fleet key): `require_private` refuses one that anyone but its
reader's side can read or anyone but its owner can write, before a byte of it is used.

Passes: mode 0400 / 0600 owned by the reading user or root (`spectrain run` writes 0600), and the
kubelet's Secret volume under the pod's fsGroup: 0440, owner root, group the fsGroup, which the
pod's processes hold as a supplementary group (nobody outside the pod does). Refused: readable by
others (o+r), writable by the group or others, group-readable through a group this process is not
in (its other members could read it), owned by another user (who can chmod it at will), not a
regular file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from spectrain_api.errors import ConfigError

PRIVATE_MODES = "0400 or 0600"


def _problem(st: os.stat_result) -> str:
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid not in (0, os.geteuid()):
        return (f"it is owned by uid {st.st_uid}, neither root nor this process's user ({os.geteuid()}); "
                "its owner can change its mode at will")
    if mode & stat.S_IROTH:
        return "every user of the machine can read it (o+r)"
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "users other than its owner can write it (g+w or o+w)"
    if mode & stat.S_IRGRP and st.st_gid not in {os.getegid(), *os.getgroups()}:
        return f"group {st.st_gid} can read it and this process is not in that group (its members are not the job's)"
    return ""


def require_private(path: str | os.PathLike[str], what: str) -> None:
    """Refuse `path` (described as `what`, e.g. the env var that named it) unless only its owner
    and this process's side can read it and only its owner can write it. A missing file is left to
    the reader's own error."""
    try:
        st = os.stat(path)        # a Secret volume's files are symlinks into ..data: the file itself counts
    except OSError:
        return                    # missing or unreadable: the reader says so when it opens it
    problem = _problem(st)
    if problem:
        raise ConfigError(
            f"{what} {str(Path(path))!r} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, "
            f"group gid {st.st_gid}) is refused: {problem}. Fix: `chmod {PRIVATE_MODES[:4]} {path}` and "
            f"`chown $(id -u) {path}` (mode {PRIVATE_MODES}, owned by the user that reads it); on a cluster "
            "mount it from its Secret with defaultMode 0400 under the pod's fsGroup (0440, root:<fsGroup>), "
            "as the operator does")


def read_hex_key(path: str | os.PathLike[str] | None, n_bytes: int, what: str, env: str, mounted: str) -> bytes:
    """`n_bytes` bytes from a private file of 2 * n_bytes hex characters (whitespace around them
    ignored): `what` names the key in errors, `env` the variable that names the file, `mounted` what
    sets it on a cluster. ConfigError naming the variable and the fix when unset, unreadable, not
    private (require_private) or malformed."""
    where = f"{env} ({mounted})"
    if not path:
        raise ConfigError(f"{env} is not set: the drafter exchange needs {what}; on a cluster {mounted} sets it")
    require_private(path, f"{what} ({env})")
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r} named by {where}: {exc.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != n_bytes:
        raise ConfigError(f"{what} {str(path)!r} ({env}) must hold {2 * n_bytes} hex characters")
    return key


__all__ = ["PRIVATE_MODES", "read_hex_key", "require_private"]
