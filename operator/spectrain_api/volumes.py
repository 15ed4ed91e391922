"""The one parser of the volume URIs a SpecTrainJob names (`spec.target.data.source`,
`spec.target.model.path`): `file:///abs/dir` (a path every pod sees) and `pvc://<claim>/<path>`
(a PersistentVolumeClaim the operator mounts read-only under $SPECTRAIN_DATA_ROOT).

`parse(field, uri)` gives a `VolumeURI` or a ConfigError naming the field and the fix; the operator
reads the claim from it, the workloads its local path. No file system access here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from spectrain_api.errors import ConfigError

FILE_SCHEME = "file://"
PVC_SCHEME = "pvc://"
BUILTIN_SCHEME = "builtin:"
FORMS = "file:///abs/dir or pvc://<claim>/<path>"
HUB_ID_HINT = ("a Hugging Face hub id is not fetched at run time: download it into a volume first "
               "(docs/bring-your-model.md) and give its directory")


@dataclass(frozen=True)
class VolumeURI:
    """`file`: `path` is absolute, `claim` None. `pvc`: `claim` names the PVC and `path` is the
    path inside it ('' for its root)."""

    scheme: str      # "file" | "pvc"
    path: str
    claim: str | None = None

    def local_path(self, data_root: str) -> PurePosixPath:
        """Where a pod finds it: the path itself, or the claim's mount under `data_root`."""
        if self.claim is None:
            return PurePosixPath(self.path)
        return PurePosixPath(data_root) / self.claim / self.path


def is_hub_id(uri: str) -> bool:
    """"org/name": what a Hugging Face hub id looks like (no scheme, one slash, not absolute)."""
    return "://" not in uri and uri.count("/") == 1 and not uri.startswith("/")


def parse(field: str, uri: object) -> VolumeURI:
    """The URI at `field`, or ConfigError saying what is wrong and which forms are accepted."""
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"{field}: must be {FORMS}")
    if uri.startswith(FILE_SCHEME):
        path = uri[len(FILE_SCHEME):]
        if not path.startswith("/"):
            raise ConfigError(f"{field} {uri!r}: file:// needs an absolute path (file:///abs/dir)")
        return VolumeURI("file", path)
    if uri.startswith(PVC_SCHEME):
        rest = uri[len(PVC_SCHEME):].strip("/")
        if not rest:
            raise ConfigError(f"{field} {uri!r}: use pvc://<claim>/<path>")
        claim, _, path = rest.partition("/")
        return VolumeURI("pvc", path, claim)
    if is_hub_id(uri):
        raise ConfigError(f"{field} {uri!r}: {HUB_ID_HINT}")
    raise ConfigError(f"{field} {uri!r}: use {FORMS}")


def errors(field: str, uri: object) -> list[str]:
    """`parse`'s refusal as a list (the rules collect every problem of a spec)."""
    try:
        parse(field, uri)
    except ConfigError as exc:
        return [str(exc)]
    return []


def claim_of(uri: str | None) -> str | None:
    """The PVC a well-formed pvc:// URI names; None for anything else."""
    if not uri:
        return None
    try:
        return parse("uri", uri).claim
    except ConfigError:
        return None
