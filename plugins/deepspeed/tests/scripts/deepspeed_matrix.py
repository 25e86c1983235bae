"""Worker script of plugins/deepspeed/tests/test_deepspeed.py (run with `accel launch -n 2 --plugin deepspeed ...`).

One process group for the whole script (created here, so each Kernel reuses it), then the same DDP-style training
loop under several Kernels: DDP (the reference), ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-2 with the optimizer offloaded to
the CPU, ZeRO-2 in bf16, a student trained against a frozen teacher (DDP and ZeRO-3), and the refusal of a second
trained model. Gradient accumulation is 3 over 8 batches per epoch, so every epoch ends with a short cycle that the
kernel syncs early. Results go to OUT/result.json (process 0) and OUT/<name>.safetensors (exported weights).
:func:`run` runs it all in a process group that exists already (deepspeed_cases.py runs it beside other scripts).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel, UsageError

GAS = 3
CLIP = 0.5


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=gen)
    y = (x[:, :1] * 2 - x[:, 1:2]).sin() + 0.1 * torch.randn(64, 1, generator=gen)
    return TensorDataset(x, y)


def train(out: Path, name: str, kernel: Kernel, teacher: bool = False) -> dict:
    """The DDP script's loop, unchanged for every strategy."""
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    loader = DataLoader(data(), batch_size=4, shuffle=True)
    if teacher:
        tutor = net(seed=7).requires_grad_(False)
        model, tutor, optimizer, loader, scheduler = kernel.prepare(model, tutor, optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = kernel.prepare(model, optimizer, loader, scheduler)
    losses, norms, lrs = [], [], []
    started = time.perf_counter()
    for _ in range(2):
        for x, y in loader:
            with kernel.accumulate(model):
                target = tutor(x) if teacher else y
                loss = nn.functional.mse_loss(model(x), target)
                kernel.backward(loss)
                norm = kernel.clip_grad_norm_(model.parameters(), CLIP) if kernel.sync_gradients else None
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(float(kernel.reduce(loss.detach(), "mean")))
            if norm is not None:
                norms.append(float(norm))
                lrs.append(optimizer.param_groups[0]["lr"])
    state = kernel.get_state_dict(model)
    if kernel.is_main_process:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, out / f"{name}.safetensors")
    result = {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "seconds": time.perf_counter() - started,
        "dtypes": sorted({str(v.dtype) for v in state.values()}),
        "keys": sorted(state),
    }
    if teacher:
        result["teacher_type"] = type(getattr(tutor, "module", tutor)).__name__
        exported = kernel.get_state_dict(tutor)  # frozen: still the weights it was built with
        if kernel.is_main_process:
            original = net(seed=7).state_dict()
            result["teacher_export"] = sorted({str(v.dtype) for v in exported.values()})
            result["teacher_unchanged"] = all(torch.equal(exported[k].float(), original[k]) for k in original)
    kernel.end_training()
    return result


RUNS = {
    "ddp": dict(plugins=["ddp"]),
    "zero1": dict(plugins=["deepspeed"], zero_stage=1),
    "zero2": dict(plugins=["deepspeed"], zero_stage=2),
    "zero3": dict(plugins=["deepspeed"], zero_stage=3),
    "zero2_offload": dict(plugins=["deepspeed"], zero_stage=2, offload_optimizer_device="cpu"),
    "zero3_offload": dict(
        plugins=["deepspeed"], zero_stage=3, offload_optimizer_device="cpu", offload_param_device="cpu"
    ),
    "zero2_bf16": dict(plugins=["deepspeed"], zero_stage=2, mixed_precision="bf16"),
    "zero3_bf16_16bit": dict(plugins=["deepspeed"], zero_stage=3, mixed_precision="bf16", zero3_save_16bit_model=True),
}


def run(out: Path, only: list[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for name, kwargs in RUNS.items():
        if only and name not in only:
            continue
        results[name] = train(out, name, Kernel(gradient_accumulation_steps=GAS, **kwargs))
    if not only or "teacher" in only:
        results["teacher_ddp"] = train(
            out, "teacher_ddp", Kernel(plugins=["ddp"], gradient_accumulation_steps=GAS), teacher=True
        )
        results["teacher_zero3"] = train(
            out,
            "teacher_zero3",
            Kernel(plugins=["deepspeed"], zero_stage=3, gradient_accumulation_steps=GAS),
            teacher=True,
        )
        results["teacher_zero3_bf16"] = train(
            out,
            "teacher_zero3_bf16",
            Kernel(plugins=["deepspeed"], zero_stage=3, mixed_precision="bf16", gradient_accumulation_steps=GAS),
            teacher=True,
        )
        kernel = Kernel(plugins=["deepspeed"], zero_stage=2)
        a, b = net(), net(1)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        loader = DataLoader(data(), batch_size=4)
        try:
            kernel.prepare(a, b, oa, ob, loader)
            results["two_trained"] = "accepted"
        except UsageError as exc:
            results["two_trained"] = str(exc)
        kernel.end_training()
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":  # deepspeed_matrix.py OUT [NAME,...]: only those runs ("teacher": the teacher runs)
    os.environ.setdefault("ACCEL_DEEPSPEED_VERBOSE", "")
    dist.init_process_group("gloo")
    run(Path(sys.argv[1]), sys.argv[2].split(",") if len(sys.argv) > 2 else None)
    dist.destroy_process_group()
