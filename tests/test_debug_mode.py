"""Debug mode (accel/debug.py) on 2 real processes: with ``--debug`` or ``ACCELERATE_DEBUG_MODE=1`` every collective
first checks that all processes make the same call, and a mismatch raises the same one-line
``DistributedOperationError`` on every process (no hang, no backend error); what matches works as without debug.
Without debug the plugin's collectives are used as they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accel import DistributedOperationError, UsageError
from accel.testing import make_kernel

ROOT = Path(__file__).resolve().parents[1]
ACCEL = Path(sys.executable).with_name("accel")
WORKER = ROOT / "tests" / "scripts" / "debug_mode_checks.py"

#: What each mismatched case of the worker must name on both processes.
EXPECTED = {
    "mismatched_gather": ["gather() at debug_mode_checks.py:", "all_gather float32[2, 3]", "all_gather float32[2, 5]"],
    "different_operations": ["process 0: gather() at", "process 1: reduce() at", "all_reduce(sum) float32[2]"],
    "mismatched_reduce_dtype": ["all_reduce(sum) float32[3]", "all_reduce(sum) float64[3]"],
    "mismatched_broadcast": ["broadcast(from process 0) float32[2]", "broadcast(from process 0) float32[3]"],
    "pad_against_gather": ["process 0: pad_across_processes() at", "process 1: gather() at"],
    "gather_object_against_barrier": ["gather_object() at", "wait_for_everyone() at", "-> barrier"],
}


def launch(tmp_path: Path, *flags: str, script_args: tuple[str, ...] = (), **env: str) -> dict[int, dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    environ.update(ACCEL_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    cmd = [str(ACCEL), "launch", "-n", "2", *flags, str(WORKER), str(out), *script_args]
    proc = subprocess.run(cmd, env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


MATCHED = {
    "gather": [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]],
    "reduce": [2.0, 2.0],
    "broadcast": [0.0, 0.0],
    "pad": [1.0, 0.0],  # process 0's row, padded to process 1's length
    "gather_object": [0, 1],
}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--debug", "ACCELERATE_DEBUG_MODE", "debug: true", "Kernel(debug=True)"])
def test_mismatched_collectives_raise_one_clear_error_on_every_process(tmp_path: Path, how: str) -> None:
    if how == "--debug":
        ranks = launch(tmp_path, "--debug")
    elif how == "ACCELERATE_DEBUG_MODE":
        ranks = launch(tmp_path, ACCELERATE_DEBUG_MODE="1")
    elif how == "debug: true":
        config = tmp_path / "config.yaml"
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\ndebug: true\n")
        ranks = launch(tmp_path, "--config_file", str(config))
    else:
        ranks = launch(tmp_path, script_args=("kernel-argument",))
    for rank, got in ranks.items():
        assert got["debug"] is True and got["collectives"] == "CheckedCollectives"
        for case, needles in EXPECTED.items():
            assert got[case] is not None, f"process {rank}: {case} did not raise"
            kind, message = got[case]
            assert kind == "DistributedOperationError" and "\n" not in message, (case, message)
            assert message.startswith(f"debug mode (process {rank}): "), message
            for needle in needles:
                assert needle in message, f"process {rank}, {case}: {needle!r} not in {message!r}"
        # the processes are still in step after the errors: the same calls work as without debug
        assert got["matched"]["gather"] == got["matched_after"]["gather"] == MATCHED["gather"]
    assert ranks[0]["matched"]["pad"] == MATCHED["pad"]
    assert ranks[0]["matched"]["gather_object"] == ranks[1]["matched"]["gather_object"] == [0, 1]
    # both processes say the same thing, apart from which one is speaking
    for case in EXPECTED:
        assert ranks[0][case][1].replace("debug mode (process 0)", "debug mode (process 1)") == ranks[1][case][1]


@pytest.mark.slow
def test_without_debug_the_collectives_are_the_plugins_and_behave_the_same(tmp_path: Path) -> None:
    ranks = launch(tmp_path)
    for got in ranks.values():
        assert got["debug"] is False and got["collectives"] != "CheckedCollectives"
        assert "mismatched_gather" not in got
        assert got["matched"]["gather"] == MATCHED["gather"] and got["matched"]["reduce"] == MATCHED["reduce"]
        assert got["matched"]["gather_object"] == MATCHED["gather_object"]


def test_debug_is_off_by_default_and_read_from_kernel_argument_and_accelerate_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert make_kernel().settings["debug"] is False
    assert make_kernel(debug=True).settings["debug"] is True  # one process: nothing to check, nothing wrapped
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "true")
    assert make_kernel().settings["debug"] is True
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "maybe")
    with pytest.raises(UsageError, match="ACCELERATE_DEBUG_MODE"):
        make_kernel()


def test_the_error_is_an_accel_error_exported_from_accel() -> None:
    import accel

    assert accel.DistributedOperationError is DistributedOperationError
    assert issubclass(DistributedOperationError, accel.AccelError) and not issubclass(
        DistributedOperationError, UsageError
    )
