"""Saves automatic checkpoints in a loop until it is killed (the kill -9 test).

Before each save every parameter and momentum buffer is set to the step number, so a loaded checkpoint can be
checked for consistency: a mix of two saves would show two numbers. Prints ``saved <step>`` after each save returns.
On start-up it resumes from the newest complete checkpoint of the project, checks that every parameter and buffer
holds its step and prints ``resumed <step>`` (``resumed 0``: nothing to resume from).

    python ckpt_crash.py PROJECT_DIR [--async] [--check]     (or under accel launch -n 2 --plugin ddp)

``--async``: ``save_state(asynchronous=True)`` (``saved <step>`` then means the copy is done; the save is published
when the next one starts). With ``ACCEL_ASYNC_SAVE_OVERLAP=1`` the copy of the weights and momentum is made in the
background, and the script steps its optimizer (which waits for it) before it changes them. ``--check``: resume, train one step, exit. Each process prints ``pid <rank> <pid>`` first.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

from accel import Kernel, ProjectConfiguration


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def build(project: str) -> tuple[Kernel, Any, Any, Progress]:
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    kernel = Kernel(project_dir=project, project_config=config)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 2.1 M parameters, 8 MB
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = kernel.prepare(model, opt)
    kernel.backward(model(torch.ones(1, 1024)).sum())  # one real step: the optimizer gets momentum buffers
    opt.step()
    opt.zero_grad()
    progress = Progress()
    kernel.register_for_checkpointing(progress)
    return kernel, model, opt, progress


def fill(model: Any, opt: Any, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
        for state in opt.state.values():
            state["momentum_buffer"].fill_(value)


def check(model: Any, opt: Any, step: int) -> None:
    """Every parameter and momentum buffer holds ``step``: the loaded checkpoint comes from one single save."""
    values = {float(v) for p in model.parameters() for v in p.detach().unique()}
    values |= {float(v) for state in opt.state.values() for v in state["momentum_buffer"].unique()}
    if values != {float(step)}:
        raise SystemExit(f"checkpoint of step {step} mixes saves: values {sorted(values)[:5]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project")
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    kernel, model, opt, progress = build(args.project)
    print(f"pid {kernel.process_index} {os.getpid()}", flush=True)
    if kernel.latest_checkpoint() is not None:
        kernel.load_state()  # go on from the newest complete checkpoint, as a restarted job would
        check(model, opt, progress.step)
    print(f"resumed {progress.step}", flush=True)
    if args.check:  # and training goes on from there
        kernel.backward(model(torch.ones(1, 1024, device=kernel.device)).sum())
        opt.step()
        opt.zero_grad()
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise SystemExit("training after resuming gave non-finite parameters")
        kernel.end_training()
        return
    overlap = bool(kernel.settings["async_save_overlap"])  # ACCEL_ASYNC_SAVE_OVERLAP=1
    while True:
        progress.step += 1
        if overlap:  # the contract: change the trained tensors only after an optimizer step (which waits for the
            opt.step()  # copy left to the background thread); no gradients, so this step changes nothing itself
        fill(model, opt, float(progress.step))
        kernel.save_state(asynchronous=args.asynchronous)
        print(f"saved {progress.step}", flush=True)


if __name__ == "__main__":
    main()
