"""Training script of the checkpoint tests (one process or `accel launch -n 2`).

Dropout, a shuffled dataloader, noise from python's, numpy's and torch's generators, gradient accumulation and an LR
schedule, so that a resumed run matches an uninterrupted one only if every piece of state is restored.

    --steps N --out F                       train N steps, write final model/optimizer state to F (main process)
    --save-at K --ckpt D                    ... but stop after step K: save_state(D), (--out F) write F, exit
    --save-on-main                          ... with save_state inside `if kernel.is_main_process` (diffusers);
                                            with --project, first an automatic one (refused)
    --resume --ckpt D                       load_state(D) first (--loaded-out F: then write F)
    --project P --save-every M              automatic checkpoints in P; resume from the latest one at start-up
    --kill-at S --marker F                  (elastic test) the last process SIGKILLs itself at step S, once
    --async-save                            Kernel(async_save=True): every save_state is asynchronous
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, ProjectConfiguration, UsageError


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--ckpt")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--disturb", action="store_true", help="reseed after loading (negative control)")
    parser.add_argument("--out")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--project")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--marker")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--save-on-main", action="store_true")
    parser.add_argument("--loaded-out")
    args = parser.parse_args()

    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2) if args.project else None
    kernel = Kernel(
        gradient_accumulation_steps=args.accum,
        project_dir=args.project,
        project_config=config,
        async_save=args.async_save,
        **({"save_join_timeout": 0.3} if args.save_on_main else {}),
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(101, 6, generator=gen), torch.randn(101, 1, generator=gen)
    dl = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, num_workers=args.workers)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    model, opt, dl, sched = kernel.prepare(model, opt, dl, sched)
    progress = Progress()
    kernel.register_for_checkpointing(progress)
    if args.resume:
        kernel.load_state(args.ckpt)
        if args.loaded_out:
            write_out(kernel, model, opt, sched, progress, args.loaded_out)
    elif args.project and kernel.latest_checkpoint() is not None:
        loaded = kernel.load_state()
        print(f"[rank {kernel.process_index}] resumed from {loaded} at step {progress.step}", flush=True)
    if args.disturb:
        torch.manual_seed(999)

    while progress.step < args.steps:
        for xb, yb in dl:
            with kernel.accumulate(model):
                noise = 0.01 * torch.randn_like(xb) * (1 + random.random()) * (1 + float(np.random.rand()))
                loss = nn.functional.mse_loss(model(xb + noise), yb)
                kernel.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            progress.step += 1
            if args.save_every and progress.step % args.save_every == 0:
                kernel.save_state()
            if (
                args.kill_at
                and progress.step == args.kill_at
                and kernel.is_last_process
                and not Path(args.marker).exists()
            ):
                Path(args.marker).write_text("killed once\n")
                os.kill(os.getpid(), signal.SIGKILL)
            if progress.step == args.save_at:
                if args.save_on_main and args.project and kernel.is_main_process:
                    try:  # automatic naming alone: refused in one line (collective in Accelerate too)
                        kernel.save_state()
                    except UsageError as exc:
                        print(f"refused: {exc}", flush=True)
                if kernel.is_main_process or not args.save_on_main:
                    kernel.save_state(args.ckpt)
                if args.out:
                    write_out(kernel, model, opt, sched, progress, args.out)
                kernel.end_training()
                return
            if progress.step == args.steps:
                break
    if args.out:
        write_out(kernel, model, opt, sched, progress, args.out)
    kernel.end_training()


def write_out(kernel: Kernel, model: nn.Module, opt: Any, sched: Any, progress: Progress, out: str) -> None:
    """The training state, for comparisons between runs (main process)."""
    if kernel.is_main_process:
        torch.save(
            {
                "model": kernel.unwrap_model(model).state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "step": progress.step,
            },
            out,
        )


if __name__ == "__main__":
    main()
