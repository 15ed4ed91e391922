"""Each algorithm readable on one screen: no function of the operator or of the mode loops is over
80 lines (the mode loops are where three hand-written loops used to grow apart)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_FUNCTION_LINES = 80
MODE_LOOPS = ("workloads/spectrain_workloads/loop.py", "workloads/spectrain_workloads/target/trainer.py",
              "workloads/spectrain_workloads/target/async_pipeline.py", "workloads/spectrain_workloads/rl/mode.py")


def long_functions(path: Path) -> list[str]:
    return [f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno is not None
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_of_the_operator_or_the_mode_loops_is_over_80_lines() -> None:
    files = sorted((ROOT / "operator" / "spectrain_operator").rglob("*.py")) + [ROOT / p for p in MODE_LOOPS]
    assert all(f.is_file() for f in files) and len(files) > len(MODE_LOOPS)
    too_long = [hit for f in files for hit in long_functions(f)]
    assert not too_long, too_long


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = tmp_path / "long.py"
    src.write_text(f"def short() -> None:\n    pass\n\n\ndef f() -> None:\n{body}\n")
    assert [h.split()[1] for h in long_functions(src)] == ["f"]
