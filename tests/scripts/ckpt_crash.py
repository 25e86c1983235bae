"""Saves automatic checkpoints in a loop until it is killed (the kill -9 test).

Before each save every parameter and momentum buffer is set to the step number, so a loaded checkpoint can be
checked for consistency: a mix of two saves would show two numbers. Prints ``saved <step>`` after each save returns.
On start-up it resumes from the newest complete checkpoint of the project.

    python ckpt_crash.py PROJECT_DIR
"""

from __future__ import annotations

import sys
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


def main() -> None:
    kernel, model, opt, progress = build(sys.argv[1])
    if kernel.latest_checkpoint() is not None:
        kernel.load_state()  # go on from the newest complete checkpoint, as a restarted job would
    while True:
        progress.step += 1
        fill(model, opt, float(progress.step))
        kernel.save_state()
        print(f"saved {progress.step}", flush=True)


if __name__ == "__main__":
    main()
