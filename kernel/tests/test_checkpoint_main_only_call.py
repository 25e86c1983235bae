"""``save_state`` called by the main process alone is known from the script's own line (``if
accelerator.is_main_process:``, diffusers' way), so the main process saves at once instead of waiting
``save_join_timeout`` for processes that will not come. These check the reading of the source; the launched runs
that save this way are tests/test_checkpoint_processes.py and the diffusers script in tests/compat."""

from __future__ import annotations

from pathlib import Path

import pytest

from accel.checkpoint.solo import _guard

CASES = [
    ("if accelerator.is_main_process:\n    accelerator.save_state(p)\n", 2, "if accelerator.is_main_process"),
    (
        "if flag and kernel.is_local_main_process:\n    kernel.save_state(p)\n",
        2,
        "if flag and kernel.is_local_main_process",
    ),
    ("if not kernel.is_main_process:\n    pass\nelse:\n    kernel.save_state(p)\n", 4, "if not kernel.is_main_process"),
    ("if state.process_index == 0:\n    k.save_state(p)\n", 2, "if state.process_index == 0"),
    ("if 0 == local_process_index:\n    k.save_state(p)\n", 2, "if 0 == local_process_index"),
    ("@accelerator.on_main_process\ndef save():\n    accelerator.save_state(p)\n", 3, "@accelerator.on_main_process"),
    (
        "if accelerator.is_main_process:\n    for i in range(3):\n        if i:\n            accelerator.save_state(p)\n",
        4,
        "if accelerator.is_main_process",
    ),
    # not guarded: every process (may) come
    ("kernel.save_state(p)\n", 1, None),
    ("if kernel.is_main_process or not flag:\n    kernel.save_state(p)\n", 2, None),
    ("if kernel.is_main_process:\n    pass\nelse:\n    kernel.save_state(p)\n", 4, None),
    ("if not kernel.is_main_process:\n    kernel.save_state(p)\n", 2, None),
    ("if kernel.process_index == 1:\n    kernel.save_state(p)\n", 2, None),
    ("if kernel.is_main_process:\n    pass\nkernel.save_state(p)\n", 3, None),
]


@pytest.mark.parametrize(("source", "line", "guard"), CASES)
def test_the_guard_of_the_calling_line(tmp_path: Path, source: str, line: int, guard: str | None) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    assert _guard(str(script), line) == guard


def test_a_file_that_cannot_be_read_is_no_guard(tmp_path: Path) -> None:
    assert _guard(str(tmp_path / "missing.py"), 1) is None
    broken = tmp_path / "broken.py"
    broken.write_text("if (:\n")
    assert _guard(str(broken), 1) is None
