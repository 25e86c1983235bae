"""The main suite's session plugins and shared helpers.

- tests/suite_budget.py: time per module and the suite's budget (registered for the whole session, so it also
  times kernel/tests and plugins/*/tests when they run in the same session).
- The cross-plugin suites reuse two plugin suites' helpers: the fsdp worker and reference run
  (``plugins/fsdp/tests``, for test_parallel_fsdp.py) and the DeepSpeed launch environment (``plugins/deepspeed/tests``
  dstools.py, re-exported by clitools.py). Their folders go on ``sys.path`` as pytest's default import mode puts a
  test module's own folder there.
"""

from __future__ import annotations

import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
for _name in ("fsdp", "deepspeed"):
    if str(PLUGINS / _name / "tests") not in sys.path:
        sys.path.insert(0, str(PLUGINS / _name / "tests"))

from suite_budget import pytest_configure  # noqa: E402

__all__ = ["pytest_configure"]
