"""Worker script of plugins/deepspeed/tests/test_deepspeed.py: exact resume of DeepSpeed runs through kernel.save_state/load_state.

For each setting (ZeRO-2, ZeRO-3, ZeRO-2 bf16, ZeRO-3 with a frozen teacher prepared separately): a run trains 2 epochs (shuffled data, dropout, accumulation 2,
clipping, StepLR) and saves its state after 6 micro-batches (a sync step, mid-epoch). Then a fresh Kernel with
a differently initialised model loads that checkpoint and finishes the same 2 epochs. The losses after the save
point and the final weights are compared (exactly), plus: reloading into the *same* engine after it trained on,
and kernel.save_model's consolidated file. Results: OUT/result.json (process 0). :func:`run` runs it all in a process
group that exists already (deepspeed_cases.py runs it beside other scripts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import CheckpointError, Kernel, UsageError
from accel.checkpoint import MANIFEST

SAVE_AT = 6


class Progress:
    """The loop's own position (epoch), checkpointed with register_for_checkpointing."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def build(kwargs: dict, seed: int) -> tuple:
    teacher = kwargs.pop("teacher", False)
    kernel = Kernel(gradient_accumulation_steps=2, **kwargs)
    model = net(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    progress = Progress()
    kernel.register_for_checkpointing(progress)
    model, optimizer, loader, scheduler = kernel.prepare(model, optimizer, loader, scheduler)
    tutor = None
    if teacher:  # a frozen model with other weights each time: only load_state can make the runs agree
        torch.manual_seed(seed + 100)
        tutor = kernel.prepare(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).requires_grad_(False))
    return kernel, progress, model, optimizer, loader, scheduler, tutor


def train(parts: tuple, save_to: Path | None = None) -> list[float]:
    kernel, progress, model, optimizer, loader, scheduler, tutor = parts
    losses, done = [], 0
    while progress.epoch < 2:
        for x, y in loader:
            with kernel.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y if tutor is None else tutor(x))
                kernel.backward(loss)
                kernel.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            done += 1
            if save_to is not None and done == SAVE_AT:
                kernel.save_state(save_to)
                losses.clear()  # compare what comes after the save point
        progress.epoch += 1
    return losses


def weights(kernel: Kernel, model: nn.Module) -> dict[str, list]:
    return {k: v.tolist() for k, v in kernel.get_state_dict(model).items()}


def mid_cycle_save_is_refused(out: Path) -> str:
    parts = build(dict(plugins=["deepspeed"], zero_stage=2), seed=0)
    kernel, _, model, optimizer, loader, _, _ = parts
    x, y = next(iter(loader))
    with kernel.accumulate(model):  # the first of 2 micro-batches: no sync yet
        kernel.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    try:
        kernel.save_state(out / "mid_cycle")
        message = "saved"
    except UsageError as exc:
        message = str(exc)
    kernel.end_training()
    return message


def run(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"mid_cycle": mid_cycle_save_is_refused(out)}
    for name, kwargs in {
        "zero2": dict(zero_stage=2),
        "zero3": dict(zero_stage=3),
        "zero2_bf16": dict(zero_stage=2, mixed_precision="bf16"),
        "zero3_teacher": dict(zero_stage=3, teacher=True),
    }.items():
        ckpt = out / f"ckpt_{name}"
        first = build(dict(plugins=["deepspeed"], **kwargs), seed=0)
        after_save = train(first, save_to=ckpt)
        final = weights(first[0], first[2])
        # load into the same engine again, after it trained on
        first[0].load_state(ckpt)
        again = train(first)
        again_final = weights(first[0], first[2])
        if name == "zero3":
            first[0].save_model(first[2], out / "export_zero3")
        # our in-memory gathering gives what DeepSpeed's zero_to_fp32 recovers from its checkpoint files
        final_dir = first[0].save_state(out / f"final_{name}")
        same_as_zero_to_fp32 = None
        if dist.get_rank() == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            recovered = get_fp32_state_dict_from_zero_checkpoint(str(Path(final_dir) / "deepspeed_model"), tag="state")
            same_as_zero_to_fp32 = {k: v.tolist() for k, v in recovered.items()} == again_final
        first[0].end_training()
        fresh = build(dict(plugins=["deepspeed"], **kwargs), seed=123)
        before_load = weights(fresh[0], fresh[2])
        fresh[0].load_state(ckpt)
        resumed = train(fresh)
        resumed_final = weights(fresh[0], fresh[2])
        fresh[0].end_training()
        manifest = json.loads((ckpt / MANIFEST).read_text())
        results[name] = {
            "after_save": after_save,
            "again": again,
            "resumed": resumed,
            "final_equal": final == resumed_final,
            "again_equal": final == again_final,
            "init_differs": before_load != final,
            "final": final,
            "same_as_zero_to_fp32": same_as_zero_to_fp32,
            "items": {
                k: {f: v.get(f) for f in ("plugin", "format", "extra")} for k, v in manifest.get("items", {}).items()
            },
        }
    # a checkpoint of a DDP run does not fit a ZeRO engine: refused before anything is loaded
    ddp = build(dict(plugins=["ddp"]), seed=0)
    train(ddp, save_to=out / "ckpt_ddp")
    ddp[0].end_training()
    zero = build(dict(plugins=["deepspeed"], zero_stage=2), seed=0)
    try:
        zero[0].load_state(out / "ckpt_ddp")
        results["ddp_into_zero"] = "loaded"
    except CheckpointError as exc:
        results["ddp_into_zero"] = str(exc)
    zero[0].end_training()
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(Path(sys.argv[1]))
    dist.destroy_process_group()
