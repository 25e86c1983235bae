"""The suite's time budget (tests/suite_budget.py): real pytest sessions (pytester, in-process) of
two small test modules, one of them slow; the budget is given through the environment as CI would."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from suite_budget import BUDGET, SERIAL_BUDGET, cpu_times

pytest_plugins = ["pytester"]


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in ("ACCEL_SUITE_BUDGET", "ACCEL_SUITE_BUDGET_MARGIN"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest("from suite_budget import pytest_configure\n")
    pytester.makepyfile(
        test_slow="import time\n\ndef test_a():\n    time.sleep(0.3)\n\ndef test_b():\n    time.sleep(0.1)\n",
        test_quick="def test_c():\n    pass\n",
    )
    return pytester


def test_reports_total_and_slowest_modules_and_passes_within_budget(suite: pytest.Pytester) -> None:
    result = suite.runpytest()
    assert result.ret == 0
    result.stdout.re_match_lines(
        [r"=+ suite time =+", rf"total \d+\.\d s wall, 2 modules \(budget {SERIAL_BUDGET:.0f} s \+ 20%"]
    )
    lines = result.stdout.lines
    first = next(i for i, line in enumerate(lines) if "slowest modules:" in line)
    assert "2 tests  test_slow.py" in lines[first + 1] and "1 tests  test_quick.py" in lines[first + 2]
    assert float(lines[first + 1].split()[0]) >= 0.4
    assert not any("budget exceeded" in line for line in lines)


def test_over_budget_fails_the_session_naming_the_slowest_module(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCEL_SUITE_BUDGET", "0.2")
    monkeypatch.setenv("ACCEL_SUITE_BUDGET_MARGIN", "0.1")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*3 passed*"])  # every test passed: the budget alone failed the session
    (line,) = [line for line in result.stdout.lines if "budget exceeded" in line]
    assert " s > 0.22 s (ACCEL_SUITE_BUDGET=0.2, margin 10%); slowest modules: test_slow.py (" in line
    assert line.index("test_slow.py") < line.index("test_quick.py")


def test_within_the_margin_passes(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_SUITE_BUDGET", "0.2")
    monkeypatch.setenv("ACCEL_SUITE_BUDGET_MARGIN", "1000")
    assert suite.runpytest().ret == 0


@pytest.mark.parametrize("value", ["0", "off"])
def test_budget_off(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ACCEL_SUITE_BUDGET", value)
    result = suite.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*2 modules (no budget); slowest modules:*"])


def test_one_module_is_not_checked(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_SUITE_BUDGET", "0.05")
    assert suite.runpytest("test_slow.py").ret == 0


def test_a_bad_value_is_one_line(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_SUITE_BUDGET", "15min")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: ACCEL_SUITE_BUDGET='15min' is not a number; give e.g. ACCEL_SUITE_BUDGET=900 (0 or off: none)"]
    )


def test_under_xdist_the_controller_reports_the_whole_session(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `-n 2` the tests run in two worker processes; the controller still prints one summary counting every
    module and fails the session over budget (the workers print and check nothing)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the workers import suite_budget too
    result = suite.runpytest_subprocess("-n", "2")
    assert result.ret == 0
    lines = result.stdout.lines
    assert sum("slowest modules:" in line for line in lines) == 1
    first = next(i for i, line in enumerate(lines) if "slowest modules:" in line)
    assert f"2 modules (budget {BUDGET:.0f} s + 20%" in lines[first]  # the budget of a run on several workers
    assert "2 tests  test_slow.py" in lines[first + 1] and "1 tests  test_quick.py" in lines[first + 2]
    monkeypatch.setenv("ACCEL_SUITE_BUDGET", "0.05")
    over = suite.runpytest_subprocess("-n", "2")
    assert over.ret == pytest.ExitCode.TESTS_FAILED
    assert sum("budget exceeded" in line for line in over.stdout.lines) == 1


def test_the_machines_idle_cpu_is_reported_per_module_and_per_test(suite: pytest.Pytester) -> None:
    """Run in one process on Linux: a module's line says how busy the machine's CPUs were during its tests, and
    the summary lists the tests by the CPU time they left idle (here every test, fewer than IDLE_SHOWN)."""
    cores = os.cpu_count() or 1
    result = suite.runpytest()
    assert result.ret == 0
    lines = result.stdout.lines
    (line,) = [line for line in lines if "tests  test_slow.py" in line]  # 0.4 s: /proc/stat counts in 10 ms ticks
    share = re.search(r"test_slow.py  \(CPUs (\d+)% busy\)$", line)
    assert share is not None and 0 <= int(share.group(1)) <= 100, line
    first = next(i for i, line in enumerate(lines) if "the tests that left the most idle:" in line)
    assert re.match(r"the machine's CPUs were \d+% busy while tests ran \(\d+ core-s idle\)", lines[first])
    idle = {line.split("core-s idle  ")[1]: float(line.split()[0]) for line in lines[first + 1 : first + 4]}
    assert set(idle) == {"test_slow.py::test_a", "test_slow.py::test_b", "test_quick.py::test_c"}
    # a test cannot leave idle more CPU time than the machine had while it ran (its wall time on every core)
    assert all(0 <= seconds <= 2.0 * cores for seconds in idle.values()), idle


def test_cpu_times_are_the_machines_and_grow() -> None:
    first = cpu_times()
    if first is None:
        pytest.skip("no /proc/stat on this system")
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # keep one CPU busy for a moment
        pass
    second = cpu_times()
    assert second is not None
    assert 0 <= first[0] <= first[1] and second[0] - first[0] >= 0.1 and second[1] - first[1] >= 0.2
