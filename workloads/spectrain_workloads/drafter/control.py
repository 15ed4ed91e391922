"""The operator's word on a drafter: disabled in place, read from the pod's downward-API file.

The operator disables a drafter without touching its target by annotating the pod
(names.ANNOTATION_DRAFTER_DISABLED); the kubelet projects the pod's annotations into the file
ENV_DRAFTER_CONTROL names, one `key="Go-quoted value"` a line, and replaces it by a symlink swap,
so a reader sees the old file or the new one, never half of one. The sidecar asks before it opens
the ring or touches the device, and the worker again at most every CONTROL_EVERY_S while it works
(a stat and a read); a drafter once disabled stays so for the life of its process and reports
REASON_DISABLED.
"""

from __future__ import annotations

import os
import time

from spectrain_api.names import ANNOTATION_DRAFTER_DISABLED, ENV_DRAFTER_CONTROL

CONTROL_EVERY_S = 1.0            # how often a working drafter re-reads its control file (a stat and a read)
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


class DrafterControl:
    """The operator's word on this drafter, from the file ENV_DRAFTER_CONTROL names (None: no file, never
    disabled). Read by path each time (the kubelet replaces it through a symlink swap), at most every
    `every_s`; once disabled, disabled for the life of the process."""

    def __init__(self, path: str | None, every_s: float = CONTROL_EVERY_S) -> None:
        self.path, self.every_s = path, every_s
        self._read_at = -float("inf")
        self._disabled = False

    @classmethod
    def from_env(cls) -> DrafterControl:
        return cls(os.environ.get(ENV_DRAFTER_CONTROL) or None)

    def disabled(self) -> bool:
        if self._disabled or self.path is None:
            return self._disabled
        now = time.monotonic()
        if now - self._read_at < self.every_s:
            return False
        self._read_at = now
        try:
            with open(self.path) as f:
                text = f.read(1 << 20)
        except OSError:
            return False      # not projected (yet): nothing says disabled
        value = parse_control(text).get(ANNOTATION_DRAFTER_DISABLED)
        self._disabled = value is not None and value.strip().lower() not in _FALSE
        return self._disabled
