"""tests/serving/: the serving clients' own loaders (speculators 0.9.0) load our exports.

They need packages that conflict with the project's venv (speculators pins transformers<=5.19.0),
so they run only under `make test-serving`, which builds .cache/serving-venv
(scripts/serving_venv.sh) and sets SPECTRAIN_SERVING_TESTS=1. Everywhere else (`make test`,
`pytest tests`) this directory collects nothing.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("SPECTRAIN_SERVING_TESTS") == "1" else ["test_*.py"]
