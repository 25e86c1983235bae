"""Two DDP processes and ``save_state`` reached at different times (run by tests/test_checkpoint_processes.py):

1. process 1 comes 2.5 s after the main process (join window 0.3 s): the main process saves alone, process 1 is
   released after ten windows with one warning, and the training steps that follow still pair;
2. the main process saves alone (diffusers' pattern), then every process saves: the second save is collective.

Writes ``OUT/times.rank<r>.json`` (seconds each save took on that process)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from accel import Kernel


def main() -> None:
    out = Path(sys.argv[1])
    kernel = Kernel(cpu=True, save_join_timeout=0.3)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = kernel.prepare(model, opt)

    def train(steps: int) -> None:
        for _ in range(steps):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            kernel.backward(loss)
            opt.step()
            opt.zero_grad()

    times: dict[str, float] = {}
    train(2)
    if kernel.process_index == 1:
        time.sleep(2.5)  # far behind the 0.3 s window even if the main process is slowed down on a loaded machine
    start = time.monotonic()
    kernel.save_state(out / "late")
    times["late"] = time.monotonic() - start
    train(2)
    if kernel.is_main_process:
        kernel.save_state(out / "alone")
    kernel.wait_for_everyone()
    start = time.monotonic()
    kernel.save_state(out / "both")
    times["both"] = time.monotonic() - start
    train(1)
    (out / f"times.rank{kernel.process_index}.json").write_text(json.dumps(times))
    kernel.end_training()


if __name__ == "__main__":
    main()
