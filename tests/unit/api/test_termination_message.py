"""exitcodes.write_termination_message: the entrypoints' fatal error line for the kubelet."""

from __future__ import annotations

from pathlib import Path

import pytest

from spectrain_api import exitcodes
from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_TERMINATION_LOG

pytestmark = pytest.mark.unit


def test_one_line_to_the_env_path_and_the_first_error_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    assert exitcodes.write_termination_message(exitcodes.fatal_message(ConfigError("spec.mode: 'X'\n  is bad")))
    assert log.read_text() == "configuration error: spec.mode: 'X' is bad"
    # another local rank failing later keeps the first error (local ranks share the file)
    assert not exitcodes.write_termination_message("RuntimeError: later")
    assert log.read_text() == "configuration error: spec.mode: 'X' is bad"
    # an empty file (what the kubelet mounts) is written
    log.write_text("")
    assert exitcodes.write_termination_message(exitcodes.fatal_message(ValueError("boom")))
    assert log.read_text() == "ValueError: boom"


def test_capped_below_the_kubelets_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    assert exitcodes.write_termination_message("é" * 10_000)
    data = log.read_bytes()
    assert len(data) <= exitcodes.MAX_TERMINATION_MESSAGE_BYTES and data.decode("utf-8") == "é" * (len(data) // 2)


def test_never_fails_and_never_creates_the_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(tmp_path / "no-such-dir" / "termination-log"))
    assert exitcodes.write_termination_message("configuration error: x") is False
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(tmp_path))   # a directory: unwritable as a file
    assert exitcodes.write_termination_message("configuration error: x") is False
    # no env: the kubelet's file only when it exists (off a cluster nothing is created in /dev)
    monkeypatch.delenv(ENV_TERMINATION_LOG)
    default = tmp_path / "dev-termination-log"
    monkeypatch.setattr(exitcodes, "TERMINATION_LOG", str(default))
    assert exitcodes.termination_log_path() is None
    assert exitcodes.write_termination_message("configuration error: x") is False and not default.exists()
    default.write_text("")
    assert exitcodes.termination_log_path() == str(default)
    assert exitcodes.write_termination_message("configuration error: x") and default.read_text() == "configuration error: x"
