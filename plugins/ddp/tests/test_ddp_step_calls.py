"""What a training step of accel's DDP loop asks of torch.distributed, counted (not timed) on 2 real processes: no
collective, rank or world-size query beyond what a hand-written DistributedDataParallel loop makes (the gradient
all-reduce is DDP's own, in C++), with and without accumulation and clipping."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accel

STEPS = 8


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith(("ACCEL_", "ACCELERATE_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ACCEL_PLUGINS", "ddp")


def c10d_calls(run: Callable[[], None]) -> list[str]:
    """The Python functions of torch.distributed's c10d module (collectives, get_rank, get_world_size, ...) that
    ``run`` calls, directly or not."""
    seen: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith("distributed_c10d.py"):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def loops(accum: int, clip: float) -> dict[str, list[str]]:
    """Run in each process: accel's loop and a raw DDP loop on the same process group, STEPS micro-steps each after
    a warm-up; the c10d calls each made while counted."""
    import torch.distributed as dist

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    kernel = accel.Kernel(gradient_accumulation_steps=accum)
    mine = model()
    ours, opt, loader = kernel.prepare(mine, torch.optim.AdamW(mine.parameters()), DataLoader(data, batch_size=4))
    batches = iter(loader)

    def accel_steps(n: int) -> None:
        for _ in range(n):
            x, y = next(batches)
            with kernel.accumulate(ours):
                kernel.backward(nn.functional.cross_entropy(ours(x), y))
                if clip and kernel.sync_gradients:
                    kernel.clip_grad_norm_(ours.parameters(), clip)
                opt.step()
                opt.zero_grad()

    held = {"raw": nn.parallel.DistributedDataParallel(model())}  # released before the group is destroyed
    raw_opt = torch.optim.AdamW(held["raw"].parameters())
    raw_batches = iter(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False)))
    done = 0

    def raw_steps(n: int) -> None:
        nonlocal done
        raw = held["raw"]
        for _ in range(n):
            x, y = next(raw_batches)
            done += 1
            if done % accum:
                with raw.no_sync():
                    (nn.functional.cross_entropy(raw(x), y) / accum).backward()
                continue
            loss = nn.functional.cross_entropy(raw(x), y)
            (loss / accum if accum > 1 else loss).backward()
            if clip:
                nn.utils.clip_grad_norm_(raw.parameters(), clip)
            raw_opt.step()
            raw_opt.zero_grad()

    accel_steps(2 * accum)
    raw_steps(2 * accum)
    counted = {"accel": c10d_calls(lambda: accel_steps(STEPS)), "raw": c10d_calls(lambda: raw_steps(STEPS))}
    assert dist.get_world_size() == 2
    held.clear()
    kernel.end_training()
    return counted


@pytest.mark.parametrize(("accum", "clip"), [(1, 0.0), (4, 1.0)])
def test_a_step_makes_no_c10d_call_a_raw_ddp_loop_does_not(accum: int, clip: float) -> None:
    results = accel.debug_launcher(loops, args=(accum, clip), num_processes=2)
    for counted in results:
        assert counted["accel"] == counted["raw"], counted
