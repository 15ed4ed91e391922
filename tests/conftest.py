"""Test tiers: unit, integration (multi-process / real kube-apiserver), e2e (opt-in --e2e), gpu.

A test module marks itself with `pytestmark = pytest.mark.<tier>`; unmarked tests count as unit.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--e2e", action="store_true", default=False,
                     help="run e2e tests against the cluster in KUBECONFIG")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_e2e = config.getoption("--e2e")
    cuda = None
    for item in items:
        names = {m.name for m in item.iter_markers()}
        if not names & {"unit", "integration", "e2e", "gpu"}:
            item.add_marker(pytest.mark.unit)
        if "e2e" in names and not run_e2e:
            item.add_marker(pytest.mark.skip(reason="e2e tier is opt-in: pass --e2e (needs KUBECONFIG)"))
        if "gpu" in names:
            if cuda is None:
                cuda = _cuda_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA: no GPU on this machine"))
