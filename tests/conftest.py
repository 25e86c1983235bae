"""The main suite's session plugins and shared helpers.

- tests/suite_budget.py: time per module and the suite's budget (registered for the whole session, so it also
  times kernel/tests and plugins/*/tests when they run in the same session).
- The cross-plugin suites reuse two plugin suites' helpers: the fsdp worker and reference run
  (``plugins/fsdp/tests``, for test_parallel_fsdp.py) and the DeepSpeed launch environment (``plugins/deepspeed/tests``
  dstools.py, re-exported by clitools.py). Their folders go on ``sys.path`` as pytest's default import mode puts a
  test module's own folder there.
- :class:`SharedFixturesStayTogether`: under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) the tests of a
  module that use one of its module- or session-scoped fixtures (a launch run once and read by several tests, a
  server, a built package) run on one worker, so the fixture is still built once; the module's other tests are spread.
"""

from __future__ import annotations

import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
for _name in ("fsdp", "deepspeed"):
    if str(PLUGINS / _name / "tests") not in sys.path:
        sys.path.insert(0, str(PLUGINS / _name / "tests"))

import pytest  # noqa: E402
import suite_budget  # noqa: E402

SHARED_SCOPES = ("class", "module", "package", "session")


class SharedFixturesStayTogether:
    """Marks ``xdist_group(<module>)`` on every test that uses a fixture of a wider scope than the function which the
    repository defines (pytest's own, e.g. ``tmp_path_factory``, have no ``baseid``). Harmless without xdist or
    with another ``--dist`` mode: loadgroup is the mode that reads the mark."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            info = getattr(item, "_fixtureinfo", None)
            if info is None or item.get_closest_marker("xdist_group"):
                continue
            if any(d.baseid and d.scope in SHARED_SCOPES for ds in info.name2fixturedefs.values() for d in ds):
                item.add_marker(pytest.mark.xdist_group(suite_budget.module_of(item.nodeid)))


def pytest_configure(config: pytest.Config) -> None:
    suite_budget.pytest_configure(config)
    if config.pluginmanager.hasplugin("xdist"):  # the xdist_group mark is registered by pytest-xdist
        config.pluginmanager.register(SharedFixturesStayTogether(), "accel-shared-fixtures-together")


__all__ = ["pytest_configure"]
