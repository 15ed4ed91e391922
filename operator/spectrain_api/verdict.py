"""The SingleContainer supervisor's verdict: written by `spectrain-supervisor` as the target
container's termination message, read back by the operator (spectrain_operator.faults).

Wire shape: ``{"spectrainSupervisor": {"cause", "targetExitCode", "drafterFailures",
"drafterDisabled", "lastDrafterExitCode", "mpsExitCode", "targetMessage"}}`` (camelCase, as in
pod status). `from_json` returns None for any other message, so a plain error line from a target
that ran without the supervisor is never mistaken for a verdict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spectrain_api.names import SUPERVISOR_VERDICT_KEY

# What ended the container: the target alone ("success" or "target"), a GPU fault shared with the
# drafter through MPS ("mps", "mps-by-drafter"), or the MPS control daemon ("mps-daemon").
CAUSES = ("success", "target", "mps", "mps-by-drafter", "mps-daemon")
# The target's fatal error line carried in the verdict (the whole verdict must stay under the
# kubelet's 4096-byte termination message limit).
MAX_TARGET_MESSAGE_CHARS = 1024

_WIRE = {  # attribute -> key
    "cause": "cause",
    "target_exit_code": "targetExitCode",
    "drafter_failures": "drafterFailures",
    "drafter_disabled": "drafterDisabled",
    "last_drafter_exit_code": "lastDrafterExitCode",
    "mps_exit_code": "mpsExitCode",
    "target_message": "targetMessage",
}


@dataclass
class SupervisorVerdict:
    cause: str = "target"
    target_exit_code: int | None = None
    drafter_failures: int = 0
    drafter_disabled: bool = False
    last_drafter_exit_code: int | None = None
    mps_exit_code: int | None = None
    target_message: str | None = None

    def to_json(self) -> str:
        return json.dumps({SUPERVISOR_VERDICT_KEY: {key: getattr(self, attr) for attr, key in _WIRE.items()}},
                          sort_keys=True)

    @classmethod
    def from_json(cls, message: str | None) -> SupervisorVerdict | None:
        """The verdict in a termination message, or None when the message is not one. Fields of the
        wrong type read as absent (a truncated or foreign message must not break the status path)."""
        try:
            data = json.loads(message or "")
        except ValueError:
            return None
        raw = data.get(SUPERVISOR_VERDICT_KEY) if isinstance(data, dict) else None
        if not isinstance(raw, dict):
            return None
        out = cls()
        cause = raw.get("cause")
        out.cause = cause if cause in CAUSES else "target"
        for attr in ("target_exit_code", "last_drafter_exit_code", "mps_exit_code"):
            setattr(out, attr, _int_or_none(raw.get(_WIRE[attr])))
        out.drafter_failures = _int_or_none(raw.get("drafterFailures")) or 0
        out.drafter_disabled = raw.get("drafterDisabled") is True
        text = raw.get("targetMessage")
        out.target_message = text[:MAX_TARGET_MESSAGE_CHARS] if isinstance(text, str) else None
        return out


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
