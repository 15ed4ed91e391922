"""Exports safe to serve (export.py) and the operator's control file (control.DrafterControl).

Versions are never reused (a high-water mark outlives pruned directories and lost checkpoints),
LATEST only moves forward, non-finite weights are refused, config.json's sha256 is checked on load,
the export gate's verdicts; the kubelet's downward-API annotations file, Go-quoted values.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from spectrain_api.errors import ConfigError
from spectrain_api.names import ANNOTATION_DRAFTER_DISABLED
from spectrain_workloads.drafter import export as ex
from spectrain_workloads.drafter.control import DrafterControl, disabled_in_status, go_unquote, parse_control
from spectrain_workloads.drafter.models import build_drafter
from spectrain_workloads.drafter.settings import DrafterSettings
from spectrain_workloads.model import model_config
from tests.waiting import wait_for

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

CFG = model_config("debug", {"n_layers": 2, "max_seq_len": 32})


def drafter(seed: int = 0) -> torch.nn.Module:
    return build_drafter(DrafterSettings(seed=seed), CFG)


def latest(root: Path) -> str:
    return (root / "LATEST").read_text().strip()


def test_a_version_is_never_reused_after_pruning_and_lost_state(tmp_path: Path) -> None:
    for v in (1, 2, 3):
        ex.export_drafter(tmp_path, v, drafter(v), {}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v2", "v3"] and latest(tmp_path) == "v3"
    v3 = (tmp_path / "v3" / "model.safetensors").read_bytes()
    for v in (1, 2, 3):       # v1 pruned, v2 and v3 present: none is written again, LATEST stays
        with pytest.raises(ex.ExportRefused, match="high-water mark v3"):
            ex.export_drafter(tmp_path, v, drafter(9), {})
    assert latest(tmp_path) == "v3" and (tmp_path / "v3" / "model.safetensors").read_bytes() == v3
    assert ex.next_export_version(tmp_path) == 4
    # every version directory and LATEST gone (a wiped volume but for the mark): still never reused
    for p in tmp_path.glob("v*"):
        shutil.rmtree(p)
    (tmp_path / "LATEST").unlink()
    assert ex.export_high_water(tmp_path) == 3
    assert ex.export_drafter(tmp_path, None, drafter(4), {}).name == "v4" and latest(tmp_path) == "v4"
    assert json.loads((tmp_path / ex.HIGH_WATER).read_text()) == {"high_water": 4}


def test_the_high_water_mark_is_the_max_of_mark_directories_and_latest(tmp_path: Path) -> None:
    assert ex.export_high_water(tmp_path / "none") == 0
    ex.export_drafter(tmp_path, 2, drafter(), {})
    (tmp_path / "v7").mkdir()                         # another writer's version without the mark
    assert ex.next_export_version(tmp_path) == 8
    (tmp_path / "LATEST").write_text("v11\n")         # LATEST names a newer one: never backwards
    with pytest.raises(ex.ExportRefused, match="v11"):
        ex.export_drafter(tmp_path, 9, drafter(), {})
    assert latest(tmp_path) == "v11" and not (tmp_path / "v9").exists()
    (tmp_path / ex.HIGH_WATER).write_text("{damaged")  # by hand: the directories and LATEST still bound it
    assert ex.export_high_water(tmp_path) == 11


def test_non_finite_weights_are_never_exported(tmp_path: Path) -> None:
    ex.export_drafter(tmp_path, 1, drafter(), {})
    bad = drafter(1)
    with torch.no_grad():
        next(p for p in bad.parameters() if p.requires_grad).view(-1)[3] = float("nan")
    with pytest.raises(ex.ExportRefused, match="not finite"):
        ex.export_drafter(tmp_path, 2, bad, {})
    assert latest(tmp_path) == "v1" and not (tmp_path / "v2").exists()
    assert ex.export_high_water(tmp_path) == 1       # a refused export reserves no number


def test_config_carries_sha256_and_load_drafter_checks_it(tmp_path: Path) -> None:
    path = ex.export_drafter(tmp_path, 1, drafter(), {})
    cfg = json.loads((path / "config.json").read_text())
    weights = path / "model.safetensors"
    assert set(cfg["sha256"]) == {"model.safetensors"} and len(cfg["sha256"]["model.safetensors"]) == 64
    ex.load_drafter(tmp_path)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF                                 # one flipped bit in the last tensor's bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="model.safetensors does not match the sha256"):
        ex.load_drafter(tmp_path)
    del cfg["sha256"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no sha256"):
        ex.load_drafter(path)


def test_extra_files_of_a_version_are_checked_too(tmp_path: Path) -> None:
    """A version's other files (the serving layouts of HF drafters) are listed and verified on load."""
    path = ex.export_drafter(tmp_path, 1, drafter(), {})
    (path / "vllm").mkdir()
    (path / "vllm" / "model.safetensors").write_bytes(b"layout")
    cfg = json.loads((path / "config.json").read_text())
    cfg["sha256"]["vllm/model.safetensors"] = ex._sha256(path / "vllm" / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg))
    ex.load_drafter(path)
    (path / "vllm" / "model.safetensors").write_bytes(b"swapped")
    with pytest.raises(ConfigError, match="vllm/model.safetensors does not match"):
        ex.load_drafter(path)


def test_gate_verdicts() -> None:
    def cause(*args: float | None, latest_exists: bool = True) -> str | None:
        v = ex.gate_verdict(*args, latest_exists=latest_exists)  # type: ignore[arg-type]
        return None if v is None else v[0]

    # the first versions (no LATEST, no floor): the finite check alone, measured or not
    assert cause(None, None, 0.0, latest_exists=False) is None and cause(1.7, None, 0.0, latest_exists=False) is None
    # paired with LATEST: no tolerance, ties pass
    assert cause(2.0, 2.0, 0.0) is None and cause(2.1, 2.0, 0.0) is None
    assert cause(1.99, 2.0, 0.0) == "below_latest"
    assert "LATEST's on the same held-back samples" in ex.gate_verdict(1.99, 2.0, 0.0, latest_exists=True)[1]  # type: ignore[index]
    # the absolute floor, with or without a LATEST
    assert cause(2.4, None, 2.5, latest_exists=False) == "below_floor" and cause(2.4, 2.0, 2.5) == "below_floor"
    assert cause(2.5, None, 2.5, latest_exists=False) is None
    # not measured while a LATEST or a floor must be met; a LATEST the round did not measure
    assert cause(None, None, 0.0) == "unmeasured" and cause(None, None, 2.0, latest_exists=False) == "unmeasured"
    assert cause(3.0, None, 0.0) == "unmeasured"
    assert cause(float("nan"), 2.0, 0.0) == "non_finite"


def test_acceptance_stderr_from_per_depth_counts() -> None:
    from spectrain_workloads.drafter.verify import Acceptance

    accepted = [0, 0, 1, 2, 4, 4, 3, 1]                   # accepted drafts of 8 chains, k = 4
    per_depth = [sum(a > j for a in accepted) for j in range(4)]
    acc = Acceptance(k=4, accepted_sum=sum(accepted), chains=len(accepted), per_depth=per_depth)
    want = torch.tensor(accepted, dtype=torch.float64).std().item() / len(accepted) ** 0.5
    assert ex.acceptance_stderr(acc.per_depth, acc.chains) == pytest.approx(want)
    assert ex.acceptance_stderr([0, 0, 0, 0], 8) == 0.0 and ex.acceptance_stderr([1], 1) == 0.0


@pytest.mark.parametrize(("quoted", "value"), [
    ('"true"', "true"),
    ('""', ""),
    ('"a \\"b\\" c"', 'a "b" c'),
    ('"back\\\\slash"', "back\\slash"),
    ('"two\\nlines\\ttab"', "two\nlines\ttab"),
    ('"caf\\u00e9 \\U0001F600"', "caf\u00e9 \U0001F600"),
    ('"caf\\xc3\\xa9"', "caf\u00e9"),                 # bytes of UTF-8
    ('"\\101\\102"', "AB"),                           # octal bytes
    ('"caf\u00e9"', "caf\u00e9"),                     # raw UTF-8 passes through
])
def test_go_unquote(quoted: str, value: str) -> None:
    assert go_unquote(quoted) == value


@pytest.mark.parametrize("bad", ["true", '"open', '"dangling\\"', '"\\q"', '"\\u12"'])
def test_go_unquote_rejects_what_is_not_a_go_string(bad: str) -> None:
    with pytest.raises(ValueError):
        go_unquote(bad)


def test_parse_control_reads_the_kubelet_annotations_file() -> None:
    text = ('kubectl.kubernetes.io/restartedAt="2026-12-02T10:00:00Z"\n'
            f'{ANNOTATION_DRAFTER_DISABLED}="DrafterCrashLoop: \\"5 failures\\"\\nsee events"\n'
            'garbage line\n'
            'half="unterminated\n')
    assert parse_control(text) == {"kubectl.kubernetes.io/restartedAt": "2026-12-02T10:00:00Z",
                                   ANNOTATION_DRAFTER_DISABLED: 'DrafterCrashLoop: "5 failures"\nsee events'}


def _project(d: Path, text: str, n: int) -> None:
    """What the kubelet does: a new timestamped directory, then an atomic swap of the ..data symlink."""
    ts = d / f"..2026_{n}"
    ts.mkdir()
    (ts / "annotations").write_text(text)
    tmp = d / "..data_tmp"
    tmp.symlink_to(ts.name)
    os.replace(tmp, d / "..data")
    if not (d / "annotations").is_symlink():
        (d / "annotations").symlink_to("..data/annotations")


def test_control_file_follows_the_kubelets_symlink_swaps(tmp_path: Path) -> None:
    assert DrafterControl(None).disabled() is False
    assert DrafterControl(str(tmp_path / "absent"), every_s=0).disabled() is False
    control = DrafterControl(str(tmp_path / "annotations"), every_s=0)
    _project(tmp_path, 'other="x"\n', 1)
    assert control.disabled() is False
    _project(tmp_path, f'other="x"\n{ANNOTATION_DRAFTER_DISABLED}="false"\n', 2)
    assert control.disabled() is False
    _project(tmp_path, f'other="x"\n{ANNOTATION_DRAFTER_DISABLED}="DrafterCrashLoop"\n', 3)
    assert control.disabled() is True
    _project(tmp_path, 'other="x"\n', 4)
    assert control.disabled() is True                # disabled for the life of the process
    throttled = DrafterControl(str(tmp_path / "annotations"), every_s=3600)
    (tmp_path / "fresh").write_text("")
    throttled.path = str(tmp_path / "fresh")
    assert throttled.disabled() is False             # read once ...
    (tmp_path / "fresh").write_text(f'{ANNOTATION_DRAFTER_DISABLED}="x"\n')
    assert throttled.disabled() is False             # ... then not again within every_s


def test_a_failure_a_peer_caused_exits_with_its_own_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spectrain_api.errors import PeerFrameError
    from spectrain_api.names import ENV_TERMINATION_LOG, EXIT_ERROR, EXIT_PEER_FRAME
    from spectrain_workloads.drafter.sidecar import _guarded

    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))

    def peer() -> int:
        raise PeerFrameError("rank 3 sent a sample with token ids past the vocabulary")

    def own() -> int:
        raise RuntimeError("the drafter's own fault")

    assert _guarded(peer) == EXIT_PEER_FRAME
    assert "PeerFrameError: rank 3 sent" in log.read_text()
    log.unlink()
    assert _guarded(own) == EXIT_ERROR


def test_control_reads_the_job_status_first_waited_for_then_in_the_background() -> None:
    """status.drafterDisabled (for this restart generation) disables; the first question waits for the
    answer (the sidecar asks before it touches the ring), later ones never block the worker."""
    answers = [{"phase": "Running"}, {"drafterDisabled": True, "drafterDisabledGeneration": 1}]
    asked = threading.Event()
    release = threading.Event()

    def read_status() -> dict[str, Any] | None:
        answer = answers.pop(0)
        if not answers:            # the second question: held until the test lets it go
            asked.set()
            release.wait(10)
        return answer

    control = DrafterControl(None, read_status=read_status, generation=1, status_every_s=0)
    assert control.disabled() is False                      # answered before returning: not disabled
    assert control.disabled() is False                      # asked in the background: returns at once
    assert asked.wait(5)
    release.set()
    wait_for(control.disabled, 5, what="the background answer")
    assert control.disabled() is True                       # for the life of the process
    assert disabled_in_status({"drafterDisabled": True, "drafterDisabledGeneration": 0}, 1) is False
    assert disabled_in_status({"drafterDisabled": True}, 1) is True
    assert disabled_in_status({"drafterDisabled": "yes"}, None) is False
    assert disabled_in_status(None, 1) is False
    outside = DrafterControl(None, read_status=lambda: None)     # no API server: nothing says disabled
    assert outside.disabled() is False
