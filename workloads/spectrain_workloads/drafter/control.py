"""The operator's word on a drafter: disabled in place, from the job's status or the pod's annotations.

The operator disables a drafter without touching its target by recording it in the job's status
(status.drafterDisabled, with the restart generation it applies to); the sidecar reads that through
the status path (podstatus.job_status: a GET of its own job, which the pod's Role allows). Pods the
operator creates in that generation afterwards also carry names.ANNOTATION_DRAFTER_DISABLED, which the
kubelet projects into the downward-API file ENV_DRAFTER_CONTROL names, one `key="Go-quoted value"` a
line, replaced by a symlink swap (a reader sees the old file or the new one, never half of one).
The sidecar asks before it opens the ring or touches the device (the file, then the status, waited
for); the worker again while it works: the file at most every CONTROL_EVERY_S (a stat and a read),
the status at most every STATUS_EVERY_S on a background thread (the training loop never waits on the
API server). A drafter once disabled stays so for the life of its process and reports REASON_DISABLED.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from spectrain_api.names import ANNOTATION_DRAFTER_DISABLED, ENV_DRAFTER_CONTROL, ENV_RESTART_GENERATION
from spectrain_workloads import podstatus

CONTROL_EVERY_S = 1.0            # how often a working drafter re-reads its control file (a stat and a read)
STATUS_EVERY_S = 10.0            # how often it asks the API server for its job's status (one GET)
REASON_DISABLED = "DisabledByOperator"
_FALSE = frozenset({"", "0", "false", "no", "off"})
_GO_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
               "\\": "\\", "'": "'", '"': '"'}


def go_unquote(text: str) -> str:
    """The value of a Go double-quoted string literal (strconv.Quote: the kubelet's downward-API format).

    Escapes \\a \\b \\f \\n \\r \\t \\v \\\\ \\' \\", \\xHH and \\OOO (bytes of UTF-8), \\uHHHH, \\UHHHHHHHH.
    ValueError for text that is not one."""
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        raise ValueError(f"not a Go-quoted string: {text!r}")
    out, i, body = bytearray(), 0, text[1:-1]
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError(f"dangling backslash in {text!r}")
        e = body[i + 1]
        if e in _GO_ESCAPES:
            out += _GO_ESCAPES[e].encode()
            i += 2
        elif e == "x":
            out.append(int(body[i + 2:i + 4], 16))
            i += 4
        elif e in "01234567":
            out.append(int(body[i + 1:i + 4], 8))
            i += 4
        elif e in "uU":
            n = 4 if e == "u" else 8
            digits = body[i + 2:i + 2 + n]
            if len(digits) != n:
                raise ValueError(f"short \\{e} escape in {text!r}")
            out += chr(int(digits, 16)).encode()
            i += 2 + n
        else:
            raise ValueError(f"unknown escape \\{e} in {text!r}")
    return out.decode("utf-8", errors="replace")


def parse_control(text: str) -> dict[str, str]:
    """Annotations from a downward-API file: one `key="Go-quoted value"` a line. Lines that are not
    (a file being replaced cannot be half-written: the kubelet swaps a symlink) are skipped."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            continue
        try:
            out[key.strip()] = go_unquote(value.strip())
        except ValueError:
            continue
    return out


def disabled_in_status(status: Any, generation: int | None) -> bool:
    """The job's status says the drafter of restart `generation` is disabled in place (a status without
    a generation, or a process that does not know its own, counts as every generation)."""
    if not isinstance(status, dict) or status.get("drafterDisabled") is not True:
        return False
    recorded = status.get("drafterDisabledGeneration")
    return generation is None or not isinstance(recorded, int) or recorded == generation


class DrafterControl:
    """The operator's word on this drafter: the file ENV_DRAFTER_CONTROL names (None: no file) and the
    job's status (`read_status`: None when there is no API server to ask). The file is read by path each
    time (the kubelet replaces it through a symlink swap), at most every `every_s`; the status at most
    every `status_every_s`, in the background after the first read. Once disabled, disabled for the life
    of the process."""

    def __init__(self, path: str | None, every_s: float = CONTROL_EVERY_S, *,
                 read_status: Callable[[], dict[str, Any] | None] | None = None, generation: int | None = None,
                 status_every_s: float = STATUS_EVERY_S) -> None:
        self.path, self.every_s = path, every_s
        self.read_status, self.generation, self.status_every_s = read_status, generation, status_every_s
        self._read_at = -float("inf")
        self._status_at = -float("inf")
        self._status_thread: threading.Thread | None = None
        self._disabled = False

    @classmethod
    def from_env(cls) -> DrafterControl:
        raw = os.environ.get(ENV_RESTART_GENERATION, "")
        generation = int(raw) if raw.isdigit() else None
        return cls(os.environ.get(ENV_DRAFTER_CONTROL) or None, read_status=podstatus.job_status,
                   generation=generation)

    def disabled(self) -> bool:
        """Whether the operator disabled this drafter. The first call waits for the status (the sidecar
        asks before it touches anything); later ones never block on the API server."""
        if self._disabled:
            return True
        now = time.monotonic()
        if self.path is not None and now - self._read_at >= self.every_s:
            self._read_at = now
            self._disabled = self._file_says_disabled()
        if not self._disabled and self.read_status is not None and now - self._status_at >= self.status_every_s:
            first = self._status_at == -float("inf")
            self._status_at = now
            if first:
                self._ask_status()
            elif self._status_thread is None or not self._status_thread.is_alive():
                self._status_thread = threading.Thread(target=self._ask_status, daemon=True,
                                                       name="spectrain-drafter-control")
                self._status_thread.start()
        return self._disabled

    def _ask_status(self) -> None:
        assert self.read_status is not None
        if disabled_in_status(self.read_status(), self.generation):
            self._disabled = True

    def _file_says_disabled(self) -> bool:
        assert self.path is not None
        try:
            with open(self.path) as f:
                text = f.read(1 << 20)
        except OSError:
            return False      # not projected (yet): nothing says disabled
        value = parse_control(text).get(ANNOTATION_DRAFTER_DISABLED)
        return value is not None and value.strip().lower() not in _FALSE
