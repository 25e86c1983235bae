"""Checkpoint worker for plugins/fsdp/tests/test_fsdp_checkpoint.py (run under ``accel launch --plugin fsdp``).

    python fsdp_ckpt_worker.py OUT --steps N [--save_at K --ckpt DIR [--reload]] [--load DIR --start K [--sharded]]

Trains a small model with dropout on a shuffled dataloader for global steps ``start .. N``; at step ``K`` saves a
checkpoint to DIR with ``save_state`` (``--reload``: ``load_state`` at once, Accelerate's #3896) and exits
(``--main_only_first``: before that, ``save_state`` inside ``if is_main_process``, which must be refused in one
line within ``save_join_timeout``; its message goes to ``OUT/main_only.txt``);
``--load`` restores DIR first with ``load_state``, or with ``--sharded`` (another number of processes than the
run that saved) checks that ``load_state`` refuses and loads model and optimizer with ``accel_fsdp.load_sharded``.
Elastic: ``--project P --save_every M --kill_at S --marker F``: automatic checkpoints every M steps, resume from
the latest at start-up, and the last process SIGKILLs itself once at step S (torchrun restarts the group).
On the main process it writes, as files in OUT: ``<tag>_model.safetensors`` (full parameters) and
``<tag>_optim.pt`` (full optimizer state) for the tags ``saved`` (just before saving), ``reloaded`` (after
``--reload``), ``loaded`` (after ``--load``) and ``final``; ``losses.json``; and ``export/`` (``save_model``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, ProjectConfiguration

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_worker import Net, finish  # noqa: E402


class DropNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.drop(x))


class Progress:
    """The global step, saved in checkpoints (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 4, generator=gen))


def full_state(kernel: Kernel, model: nn.Module, optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    params = kernel.get_state_dict(model)
    optim = get_optimizer_state_dict(
        kernel.unwrap_model(model),
        optimizer.optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )
    return params, optim


def dump(kernel: Kernel, out: Path, tag: str, model: nn.Module, optimizer: Any) -> None:
    params, optim = full_state(kernel, model, optimizer)
    if kernel.is_main_process:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in params.items()}, str(out / f"{tag}_model.safetensors"))
        torch.save(optim, out / f"{tag}_optim.pt")


def load(kernel: Kernel, directory: Path, model: nn.Module, optimizer: Any, sharded: bool) -> None:
    if not sharded:
        kernel.load_state(directory)
        return
    from accel.errors import CheckpointError
    from accel_fsdp import load_sharded

    try:
        kernel.load_state(directory)
    except CheckpointError as exc:
        assert "holds one state per process for 2 process(es)" in str(exc), exc
    else:
        raise AssertionError("load_state on another number of processes must refuse (per-process items)")
    load_sharded(kernel, directory, model=model, optimizer=optimizer)


def check_refusals(kernel: Kernel, out: Path) -> None:
    """save_state in the middle of gradient accumulation is refused (FSDP holds the partial gradients)."""
    from accel import UsageError

    kernel.sync_gradients = False
    try:
        kernel.save_state(out / "mid_accumulation")
    except UsageError as exc:
        assert "middle of gradient accumulation" in str(exc), exc
    else:
        raise AssertionError("save_state in the middle of accumulation must be refused")
    finally:
        kernel.sync_gradients = True
    assert not (out / "mid_accumulation").exists()


def main_only(kernel: Kernel, target: Path, out: Path) -> None:
    """Diffusers' ``if accelerator.is_main_process: accelerator.save_state(path)`` under a sharded strategy: refused
    on the main process, in one line, once ``save_join_timeout`` passed; nothing is written."""
    import time

    from accel import UsageError

    start = time.monotonic()
    try:
        kernel.save_state(target)
    except UsageError as exc:
        (out / "main_only.txt").write_text(json.dumps({"error": str(exc), "seconds": time.monotonic() - start}))
    else:
        raise AssertionError("save_state on the main process alone must be refused under fsdp")
    assert not target.exists()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--save_at", type=int, default=-1)
    parser.add_argument("--ckpt")
    parser.add_argument("--reload", action="store_true")
    parser.add_argument("--main_only_first", action="store_true")
    parser.add_argument("--load")
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--project")
    parser.add_argument("--save_every", type=int, default=0)
    parser.add_argument("--kill_at", type=int, default=0)
    parser.add_argument("--marker")
    args = parser.parse_args()
    out = Path(args.out)

    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2) if args.project else None
    join = {"save_join_timeout": 0.3} if args.main_only_first else {}  # the refusal comes after 10 x 0.3 s
    kernel = Kernel(cpu=True, project_dir=args.project, project_config=config, **join)
    torch.manual_seed(0 if args.load is None else 1)  # a resumed run starts from other weights: load must win
    model = DropNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    loader = DataLoader(dataset(), batch_size=8, shuffle=True)
    model, optimizer, loader, scheduler = kernel.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    kernel.register_for_checkpointing(progress)
    if kernel.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    progress.step = args.start
    if args.load:
        load(kernel, Path(args.load), model, optimizer, args.sharded)
        dump(kernel, out, "loaded", model, optimizer)
    elif args.project and kernel.latest_checkpoint() is not None:
        kernel.load_state()
    step, losses = (args.start if args.sharded else progress.step), []
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            kernel.backward(loss)
            kernel.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(float(kernel.reduce(loss.detach(), "mean")))
            step += 1
            progress.step = step
            if args.save_every and step % args.save_every == 0:
                kernel.save_state()
            if args.kill_at == step and kernel.is_last_process and not Path(args.marker).exists():
                Path(args.marker).write_text("killed once\n")
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.save_at:
                ckpt = Path(args.ckpt)
                if args.main_only_first and kernel.is_main_process:
                    main_only(kernel, ckpt.parent / "main_only", out)
                dump(kernel, out, "saved", model, optimizer)
                kernel.save_state(ckpt)
                if args.reload:  # Accelerate #3896: load_state right after save_state
                    kernel.load_state(ckpt)
                    dump(kernel, out, "reloaded", model, optimizer)
                kernel.end_training()
                finish()
            if step == args.steps:
                break
    dump(kernel, out, "final", model, optimizer)
    kernel.save_model(model, out / "export")
    check_refusals(kernel, out)
    if kernel.is_main_process:
        (out / "losses.json").write_text(json.dumps(losses))
    kernel.end_training()
    finish()


if __name__ == "__main__":
    main()
