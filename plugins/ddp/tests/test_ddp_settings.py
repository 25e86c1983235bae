"""The DistributedDataParallel settings the ddp plugin builds with (gradient_as_bucket_view on by default)
train exactly as a raw torch DDP model with torch's defaults does: two real CPU processes on gloo, one process
group, accel's prepared model and a raw DDP copy of it trained side by side with accumulation and clipping."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from test_launchers import clean_env  # noqa: F401  (autouse: only the ddp plugin, a clean environment)
from torch import nn

from accel.testing import run_tree


def train_side_by_side(accum: int) -> dict:
    """In each launched process: accel's prepared model and a raw DDP model (torch's defaults), same start, same
    batches; the largest parameter difference after 6 micro-batches, and accel's DDP settings."""
    from torch.nn.parallel import DistributedDataParallel

    from accel import Kernel

    torch.manual_seed(0)
    kernel = Kernel(gradient_accumulation_steps=accum)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    start = copy.deepcopy(net)
    raw = DistributedDataParallel(copy.deepcopy(net))
    raw_opt = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9)
    model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1 + kernel.process_index)
    for i in range(6):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        with kernel.accumulate(model):
            kernel.backward(nn.functional.mse_loss(model(x), y))
            kernel.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        sync = (i + 1) % accum == 0
        if sync:
            (nn.functional.mse_loss(raw(x), y) / accum).backward()
            nn.utils.clip_grad_norm_(raw.parameters(), 0.5)
            raw_opt.step()
            raw_opt.zero_grad()
        else:
            with raw.no_sync():
                (nn.functional.mse_loss(raw(x), y) / accum).backward()
    ours = kernel.unwrap_model(model)
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), raw.module.parameters(), strict=True))
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), start.parameters(), strict=True))
    settings = {"gradient_as_bucket_view": model.gradient_as_bucket_view, "static_graph": model.static_graph}
    kernel.end_training()
    return {"diff": diff, "settings": settings, "moved": moved}


@pytest.mark.multiprocess
def test_default_ddp_settings_train_as_raw_ddp_does() -> None:
    # debug_launcher forks: from a fresh interpreter, not from this pytest process, whose earlier tests ran torch's
    # OpenMP thread pool (a fork after that can hang the children in their first parallel region)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import accel; "
        "from test_ddp_settings import train_side_by_side; "
        "print('RESULTS', json.dumps(accel.debug_launcher(train_side_by_side, args=(2,), num_processes=2)))"
    )
    proc = run_tree([sys.executable, "-c", code, str(Path(__file__).parent)], env=dict(os.environ), timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    results = json.loads(lines[-1][len("RESULTS ") :])
    assert len(results) == 2
    for r in results:
        assert r["settings"] == {"gradient_as_bucket_view": True, "static_graph": False}
        assert r["diff"] <= 1e-6 and r["moved"] > 1e-3, r  # equal, and it did train
