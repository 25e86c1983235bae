"""The conformance kit (accel.testing.conformance) against mutants of the new-plugin templates.

Each mutant is a real plugin: the files ``accel new-plugin`` writes, changed in one place, and made discoverable
the way an installed plugin is (a distribution with an ``accel`` entry point on ``sys.path`` / ``PYTHONPATH``,
selected by the kit's ``ACCEL_PLUGINS`` allow-list). The kit must fail each with a message naming the fault. The
unchanged templates pass the same suites (tests/test_tracker_jsonl.py runs plugins/jsonl, the tracker template's
output; tests/test_plugin_template.py installs and tests both templates).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from accel.commands.new_plugin import render


def install(site: Path, name: str, kind: str, changes: dict[str, tuple[str, str]]) -> Any:
    """Write the template's package for plugin ``name`` into ``site``, with ``changes`` (``{file: (old, new)}``,
    each ``old`` found exactly once), and a distribution whose ``accel`` entry point names it. Returns an instance
    of the conformance class of the template's own tests (``tests/test_NAME.py``, unchanged)."""
    applied = set()
    files = render(name, kind)
    for path, text in files.items():
        if not path.startswith("src/"):
            continue
        file = path.removeprefix("src/")
        base = Path(file).name
        if base in changes:
            old, new = changes[base]
            assert text.count(old) == 1, f"the template's {base} changed: update this mutant ({old!r})"
            text = text.replace(old, new)
            applied.add(base)
        (site / file).parent.mkdir(parents=True, exist_ok=True)
        (site / file).write_text(text, encoding="utf-8")
    assert applied == set(changes), f"no template file {sorted(set(changes) - applied)}"
    meta = site / f"accel_plugin_{name}-0.1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: accel-plugin-{name}\nVersion: 0.1.0\n")
    (meta / "entry_points.txt").write_text(f"[accel]\n{name} = accel_{name}\n")
    tests = site.parent / f"test_{name}.py"
    tests.write_text(files[f"tests/test_{name}.py"], encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"tests_of_{name}", tests)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    title = "".join(part.capitalize() for part in name.split("_"))
    return getattr(module, f"Test{title}Conformance")()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on this process's ``sys.path`` and on its subprocesses' ``PYTHONPATH``."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    yield site
    for module in [m for m in sys.modules if m.startswith(("accel_mut", "tests_of_mut"))]:
        del sys.modules[module]
    importlib.invalidate_caches()


# ---- trackers: the JSON-lines template ------------------------------------------------------------------------

TRACKER = "tracker.py"
LOG_LINE = '        self._write({"event": "log", "step": step, "values": _plain(values)})\n'
CLOSE_LINES = "            self.run.close()\n            self.run = None\n"


@pytest.fixture
def accel_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What the tracker suite's autouse fixture does when pytest runs it: a private ACCEL_HOME."""
    home = tmp_path / "accel_home"
    monkeypatch.setenv("ACCEL_HOME", str(home))
    return home


def test_a_tracker_writing_every_row_twice_fails(site: Path, tmp_path: Path, accel_home: Path) -> None:
    suite = install(site, "mut_twice", "tracker", {TRACKER: (LOG_LINE, LOG_LINE * 2)})
    with pytest.raises(AssertionError, match=r"10 points recorded for 5 kernel.log\(\) calls.*exactly once"):
        suite.test_logs_scalars_and_config(tmp_path)


def test_a_tracker_never_closing_its_file_fails(site: Path, tmp_path: Path, accel_home: Path) -> None:
    suite = install(site, "mut_open", "tracker", {TRACKER: (CLOSE_LINES, "            pass\n")})
    with pytest.raises(
        AssertionError,
        match=r"after end_training\(\) this process still holds open "
        r"\['project/mut_open/closed.jsonl'\]",
    ):
        suite.test_end_training_closes_its_files(tmp_path)


def test_the_unchanged_tracker_template_passes_the_new_checks(site: Path, tmp_path: Path, accel_home: Path) -> None:
    """The same checks, the same installation, no mutation: they pass (so the failures above are the mutations')."""
    suite = install(site, "mut_none", "tracker", {})
    suite.test_logs_scalars_and_config(tmp_path / "a")
    suite.test_end_training_closes_its_files(tmp_path / "b")


# ---- strategies: the gradient-averaging template (two real processes) -----------------------------------------

STRATEGY = "strategy.py"
SYNC_LINE = "        if kernel.sync_gradients and kernel.num_processes > 1:\n"
WRAP_RETURN = "            self.models.append(model)\n        return list(models), list(optimizers), list(schedulers)\n"
OWN_WRAPPER = '''        import copy

        import torch

        class AvgdpModule(torch.nn.Module):
            """The strategy's own wrapper class, holding its own copy of the user's module."""

            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = copy.deepcopy(inner)

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return self.inner(*args, **kwargs)

        wrappers = [AvgdpModule(model) for model in models]
        self.models.extend(wrappers)
        return wrappers, list(optimizers), list(schedulers)
'''


MUTANTS = {
    "mut_sync": {STRATEGY: (SYNC_LINE, "        if kernel.num_processes > 1:\n")},
    "mut_wrap": {STRATEGY: (WRAP_RETURN, OWN_WRAPPER)},
}


@pytest.fixture(scope="module")
def strategy_failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Both strategy mutants through the kit's two-process training test, launched side by side (each is a
    separate `accel launch`; together they take the time of about one): ``{name: the kit's failure message}``."""
    root = tmp_path_factory.mktemp("strategy_mutants")
    site = root / "site"
    site.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        suites = {name: install(site, name, "strategy", changes) for name, changes in MUTANTS.items()}

        def run(name: str) -> str:
            try:
                suites[name].test_trains_like_one_process(root / name)
            except AssertionError as exc:
                return str(exc)
            return "passed"

        with ThreadPoolExecutor(len(suites)) as pool:
            return dict(zip(suites, pool.map(run, suites), strict=True))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_strategy_syncing_on_every_micro_batch_fails(strategy_failures: dict[str, str]) -> None:
    """Averaging gradients after every backward gives the same weights as syncing once per step (the average is
    linear): only the gradients between synchronisations show that it talked on every micro-batch."""
    assert re.search(
        r"micro-batch 0 does not synchronise .* identical gradients after it: "
        r"the strategy synchronised gradients on every micro-batch",
        strategy_failures["mut_sync"],
    ), strategy_failures["mut_sync"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_strategy_returning_its_own_wrapper_class_fails(strategy_failures: dict[str, str]) -> None:
    """Its wrapper trains a copy: the module unwrap_model returns (the user's) never learns."""
    assert re.search(
        r"the module unwrap_model\(prepared\) returns kept its initial weights through training",
        strategy_failures["mut_wrap"],
    ), strategy_failures["mut_wrap"]
