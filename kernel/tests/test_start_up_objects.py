"""``accel launch``'s start-up (its plan; torch's modules when it runs torchrun's agent) runs with Python's garbage
collector paused, and what it made is frozen out of the collector's reach afterwards; the collector is back on for
the wait on the workers."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import accel.commands.launch as launch_command
from accel.processes import start_up_objects


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """Give the test session's objects back to the collector afterwards."""
    yield
    gc.unfreeze()


def test_the_collector_is_paused_in_the_block_and_what_it_made_is_frozen() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with start_up_objects():
        assert not gc.isenabled()
        made: list[list[int]] = [[] for _ in range(100)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)


def test_a_collector_turned_off_by_the_caller_stays_off() -> None:
    gc.disable()
    try:
        with start_up_objects():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_is_back_even_when_the_block_fails() -> None:
    with pytest.raises(ValueError), start_up_objects():
        raise ValueError("bad flag")
    assert gc.isenabled()


def test_accel_launch_plans_with_the_collector_paused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n", encoding="utf-8")
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    seen: list[bool] = []
    plan = launch_command.plan_launch

    def planning(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return plan(*args, **kwargs)

    monkeypatch.setattr(launch_command, "plan_launch", planning)
    assert launch_command.launch(["--dry-run", "-q", str(script)]) == 0
    assert seen == [False]
    assert gc.isenabled()
    assert "accel launch plan (dry run" in capsys.readouterr().out
