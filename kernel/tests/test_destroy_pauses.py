"""``accel.distributed.destroy_process_group``'s pauses: after the destruction always (gloo's threads letting go of
finished work before the interpreter finalises); before it only on a torch whose destructor joins those threads
holding the GIL (before 2.8), where the pause is what keeps the destruction from hanging."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import accel.distributed as distributed


@pytest.mark.parametrize(("version", "pauses"), [("2.7.1+cpu", ["sleep", "destroy", "sleep"]), ("2.8.0", ["destroy", "sleep"]), ("2.13.0+cpu", ["destroy", "sleep"])])  # fmt: skip
def test_pause_before_destroying_only_where_the_destructor_holds_the_gil(
    monkeypatch: pytest.MonkeyPatch, version: str, pauses: list[str]
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.append("destroy"))
    monkeypatch.setattr(distributed.time, "sleep", lambda seconds: seen.append("sleep"))
    distributed.destroy_process_group()
    assert seen == pauses
