"""The headline names the serving layouts beside the exported drafter (report.summary.serving_layouts)."""

from __future__ import annotations

from pathlib import Path

from spectrain_workloads.report.render import headline
from spectrain_workloads.report.summary import serving_layouts


def test_the_layouts_beside_the_artifact_are_listed_and_printed(tmp_path: Path) -> None:
    art = tmp_path / "v3"
    for name in ("speculators", "sglang"):
        (art / name).mkdir(parents=True)
        (art / name / "config.json").write_text("{}")
    (art / "partial").mkdir()                 # no config.json: not a layout
    (art / "model.safetensors").write_bytes(b"")
    got = serving_layouts(str(art))
    assert got == [str(art / "sglang"), str(art / "speculators")]
    lines = headline({"artifact": str(art), "serving_layouts": got})
    assert any(line.split()[0] == "serving_layouts" and str(art / "sglang") in line for line in lines)


def test_no_artifact_no_layouts(tmp_path: Path) -> None:
    assert serving_layouts(None) == [] and serving_layouts(str(tmp_path / "missing")) == []
    assert not any("serving_layouts" in line for line in headline({"artifact": None, "serving_layouts": []}))
