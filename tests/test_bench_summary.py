"""bench/run.py's summary: how a wall-time row is decided, that every row it points at was counted, and what the
launched section's targets carry (the raw command run again beside accel's figure).

The benchmarks themselves run under ``make bench`` (minutes to hours, a quiet machine); these tests check the
summary's rule and the committed results it was built from, in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_run() -> ModuleType:
    """bench/run.py as a module of its own name; bench/ is on sys.path only while it imports its neighbours, so its
    modules (``memory``, ``pipeline``, ...) never shadow the test folders' helpers of the same names."""
    before = set(sys.modules)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("accel_bench_run", BENCH / "run.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        for name in set(sys.modules) - before:
            if getattr(sys.modules[name], "__file__", None) and Path(sys.modules[name].__file__).parent == BENCH:
                del sys.modules[name]
    return module


run = load_bench_run()

COUNTED = {
    "instructions per step, tiny MLP": ("+0.90% (+14,905)", True),
    "instructions per step, DDP (one process), tiny MLP, bf16": ("+3.10% (+60,000)", False),
}


def test_a_row_at_target_is_met() -> None:
    assert run.summary_verdict(True, None, COUNTED) == "yes"
    assert run.summary_verdict(True, "instructions per step, tiny MLP", COUNTED) == "yes"


def test_a_miss_within_its_spread_is_decided_by_the_count_and_says_so() -> None:
    shown = run.summary_verdict(False, "instructions per step, tiny MLP", COUNTED)
    assert shown.startswith("yes, by instructions: accel adds +0.90%")
    assert "within its rounds' middle half" in shown


def test_a_miss_stays_a_miss_without_a_count_or_when_the_count_misses() -> None:
    assert run.summary_verdict(False, None, COUNTED) == "**no**"
    assert run.summary_verdict(False, "instructions per step, DDP (one process), tiny MLP, bf16", COUNTED) == "**no**"
    assert run.summary_verdict(False, "instructions per step, never counted", COUNTED) == "**no**"


def test_a_sections_own_sentence_comes_before_the_count() -> None:
    sentence = "yes, with reseed_workers=False"
    assert run.summary_verdict(sentence, None, COUNTED) == sentence
    assert run.summary_verdict(sentence, "instructions per step, tiny MLP", COUNTED) == sentence


def test_every_row_the_summary_decides_by_a_count_points_at_a_counted_row() -> None:
    """The names the wall-time sections build (run.instructions_row, run.loader_row) must be the names the
    instruction sections gave their rows, or the rule would silently never apply."""
    results = json.loads((BENCH / "results.json").read_text(encoding="utf-8"))
    rows = [row for section in results.values() for row in section["targets"]]
    names = {row[0] for row in rows}
    checks = [row[4] for row in rows if len(row) > 4 and row[4]]
    if not checks:
        pytest.skip("bench/results.json predates the rule (no row names a count)")
    assert [c for c in checks if c not in names] == []


def test_the_launched_section_runs_the_raw_command_again_only_on_rows_with_a_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launched section's noise column: raw's own torchrun command a second time in each round, on the rows
    with a target and on no launch row, its place in the order rotating with the frameworks'."""
    launched = run.launched
    calls: list[tuple[str, list[str]]] = []

    def one_run(name: str, cmd: list[str]) -> tuple[float, float, float, dict[str, float]]:
        calls.append((name, cmd))
        return 0.5, 1.0, 1.0, {"steps_per_s": 100.0, "cpu_ms_per_step": 1.0}

    monkeypatch.setattr(launched, "run_peer", one_run)
    results = launched.measure(rounds=3, quick=True)
    for label, *_ in launched.WORKLOADS:
        again = results[label].get(launched.AGAIN)
        assert (again is not None and len(again) == 3) == (label in launched.STEP_TARGETS), label
    assert launched.AGAIN not in results["launch -> first line"]
    repeated = [cmd for name, cmd in calls if name == launched.AGAIN]
    assert repeated and all("torch.distributed.run" in cmd and cmd[-1] == "raw" for cmd in repeated)
    per_round = [[name for name, _ in calls[i : i + len(calls) // 3]] for i in range(0, len(calls), len(calls) // 3)]
    assert len({names.index(launched.AGAIN) for names in per_round}) > 1  # not always in the same place


def test_a_launched_target_quotes_the_noise_beside_accels_figure_and_is_decided_by_accel_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launched = run.launched
    monkeypatch.setattr(launched, "launchers", lambda: ({"raw": None, "accel": None}, []))

    def rows(accel: float, again: float, target: bool) -> dict[str, list[dict[str, float]]]:
        raw = {"steps_per_s": 100.0, "cpu_ms_per_step": 1.0}
        row = {"raw": [raw] * 3, "accel": [{"steps_per_s": 100 * accel, "cpu_ms_per_step": 1 / accel}] * 3}
        if target:
            row[launched.AGAIN] = [{"steps_per_s": 100 * again, "cpu_ms_per_step": 1 / again}] * 3
        return row

    ddp = "2 processes DDP, tiny"
    results = {label: rows(1.0, 1.0, label in launched.STEP_TARGETS) for label, *_ in launched.WORKLOADS}
    results[ddp] = rows(0.97, 1.05, True)
    results |= {label: {"raw": [{"seconds": 1.0}] * 3, "accel": [{"seconds": 0.9}] * 3} for label in
                ("launch -> first line", "launch -> exit", launched.LAUNCH_CPU)}  # fmt: skip
    targets: list[tuple[str, str, str, bool]] = []
    text = launched.table(results, lambda *row: targets.append(row))
    assert "| torchrun again / raw (the noise) |" in text.splitlines()[0]
    line = next(line for line in text.splitlines() if line.startswith(f"| {ddp} |"))
    assert line.endswith("| 1.050 (1.050..1.050) |")
    assert "| - |" in next(line for line in text.splitlines() if line.startswith("| 1 process, tiny MLP |"))
    verdict = {name: (measured, met) for name, _, measured, met in targets}
    measured, met = verdict[f"launched: {ddp}, accel launch / torchrun"]
    assert "torchrun again / torchrun 1.050" in measured and met is False  # the noise is quoted, never the verdict
