"""`spectrain validate` prints the EAGLE-3 rules of spectrain_api.rules, one line per error naming
the field (the case of an EAGLE-3 drafter in a mode that cannot train it, and a wrong field)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spectrain_api.names import EAGLE, EAGLE3, RL
from spectrain_operator import cli

pytestmark = pytest.mark.unit


def test_cli_validate_prints_eagle3_rule_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "metadata": {"name": "j"},
           "spec": {"mode": RL, "target": {"image": "img:1", "rl": {}}, "drafter": {"arch": EAGLE3}}}
    f = tmp_path / "eagle3-rl.yaml"
    f.write_text(yaml.safe_dump(job))
    assert cli.main(["validate", str(f)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{f}: spec.drafter.arch: {EAGLE3} trains in mode Pretrain (its stages publish the feature "
                   f"layers); mode {RL}'s rollout engine and AsyncPipeline publish the final hidden state only: "
                   f"use arch {EAGLE}"]

    job["spec"]["mode"] = "Pretrain"
    del job["spec"]["target"]["rl"]
    job["spec"]["drafter"] = {"arch": EAGLE, "draftVocabSize": 100}
    f.write_text(yaml.safe_dump(job))
    assert cli.main(["validate", str(f)]) == 1
    assert capsys.readouterr().out.strip() == (
        f"{f}: spec.drafter.draftVocabSize: only spec.drafter.arch: {EAGLE3} reads it (arch is {EAGLE}); "
        f"remove it or set arch {EAGLE3}")

    job["spec"]["drafter"] = {"arch": EAGLE3, "draftVocabSize": 100, "featureLayers": [0, 2, 3], "tttSteps": 4}
    f.write_text(yaml.safe_dump(job))
    assert cli.main(["validate", str(f)]) == 0
