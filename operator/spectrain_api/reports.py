"""What the operator takes from a pod's drafter report (status.reports.<UID>.drafter), defined once.

Any container of a job can write its pod's report (the status path's Role), so a report is a claim,
not a fact: `checked_drafter_report` keeps a field only when it is of its type and in its range, and
`artifact` only from the exporting rank's pod, naming a version directory of the job's export path.
Everything else is refused: named in `Refusal`s, never copied into status.drafter.

The exporting rank (`export_rank`) is the last rank by default: the drafter sidecar exports from it
and the operator accepts `artifact` from its pod only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from spectrain_api.names import DRAFTER_STATES

# acceptance length = accepted drafts + 1 (the target's own token), mean over verifications: at least 1;
# no draft length the drafter is configured with comes near the upper bound
ACCEPTANCE_LENGTH_RANGE = (1.0, 100.0)
HARVEST_EFFICIENCY_RANGE = (0.0, 1.0)         # harvested / usable idle time
HARVEST_CLOCK_SLACK_S = 300.0                  # clock skew between a node and the operator, at most
MAX_ARTIFACT_CHARS = 1024
MAX_VERSION_DIGITS = 9
# an export's version directory: `v<version>` under the export path (drafter.export writes `v{version}`)
_VERSION_DIR = re.compile(rf"v[0-9]{{1,{MAX_VERSION_DIGITS}}}")


def export_rank(world: int) -> int:
    """The rank whose drafter exports the combined drafter (SPECTRAIN_DRAFTER_EXPORT_RANK may
    override it in tests; the operator's pods never set it)."""
    return world - 1


@dataclass(frozen=True)
class Refusal:
    field: str
    value: str          # the refused value, cut short for a message
    why: str

    def __str__(self) -> str:
        return f"{self.field}={self.value} refused: {self.why}"


def _number(report: dict[str, Any], name: str, low: float, high: float, out: dict[str, Any],
            refused: list[Refusal]) -> None:
    if name not in report or report[name] is None:
        return
    v = report[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
        refused.append(Refusal(name, repr(v)[:40], f"not a finite number in [{low:g}, {high:g}]"))
        return
    out[name] = float(v)


def artifact_ok(value: str, export_dir: str) -> bool:
    """`value` names a version directory directly under the job's export path."""
    root = export_dir.rstrip("/")
    if not value.startswith(root + "/"):
        return False
    return _VERSION_DIR.fullmatch(value[len(root) + 1:]) is not None


def checked_drafter_report(report: dict[str, Any], *, exporting: bool, export_dir: str,
                           max_harvest_s: float) -> tuple[dict[str, Any], list[Refusal]]:
    """The fields of one pod's drafter report the operator may use (state, harvestedSeconds,
    harvestEfficiency, acceptanceLength, artifact, reason, exportsRejectedByCause, combineAdjustedByCause)
    and the refused ones. `exporting`: the pod is the exporting rank's; `max_harvest_s`: the most idle
    time its ranks can have harvested (local ranks x the job's age)."""
    out: dict[str, Any] = {}
    refused: list[Refusal] = []
    state = report.get("state")
    if state is not None:
        if state in DRAFTER_STATES:
            out["state"] = state
        else:
            refused.append(Refusal("state", repr(state)[:40], f"not one of {', '.join(DRAFTER_STATES)}"))
    if isinstance(report.get("reason"), str):
        out["reason"] = report["reason"]
    _number(report, "harvestedSeconds", 0.0, max_harvest_s, out, refused)
    _number(report, "harvestEfficiency", *HARVEST_EFFICIENCY_RANGE, out, refused)
    _number(report, "acceptanceLength", *ACCEPTANCE_LENGTH_RANGE, out, refused)
    artifact = report.get("artifact")
    if artifact not in (None, ""):
        if not exporting:
            refused.append(Refusal("artifact", repr(artifact)[:80], "only the exporting rank's pod exports"))
        elif not isinstance(artifact, str) or len(artifact) > MAX_ARTIFACT_CHARS \
                or not artifact_ok(artifact, export_dir):
            refused.append(Refusal("artifact", repr(artifact)[:80], f"not a version directory v<N> of {export_dir}"))
        else:
            out["artifact"] = artifact
    for field in ("exportsRejectedByCause", "combineAdjustedByCause"):   # counts read by cause, each checked
        if isinstance(report.get(field), dict):
            out[field] = report[field]
    return out, refused


__all__ = ["ACCEPTANCE_LENGTH_RANGE", "HARVEST_CLOCK_SLACK_S", "HARVEST_EFFICIENCY_RANGE", "Refusal", "artifact_ok",
           "checked_drafter_report", "export_rank"]
