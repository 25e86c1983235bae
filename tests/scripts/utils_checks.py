"""Worker of tests/test_utils.py (``accel launch -n 2``, ddp plugin): accel.utils and the Kernel utilities on real
processes. Writes OUT/rank<r>.json: what each rank drew after set_seed, whether its progress bar shows, what
check_trigger answered, parameter checksums under LocalSGD, the trace files of Kernel.profile and, per DDP
communication hook, the hook registered and the parameters after training."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn

from accel import Kernel
from accel.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    LocalSGD,
    ProfileKwargs,
    set_seed,
    tqdm,
)

OUT = Path(sys.argv[1])


def draws() -> list[float]:
    return [random.random(), float(numpy.random.rand()), float(torch.rand(1))]


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def batch(kernel: Kernel, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + kernel.process_index)  # different data on each rank
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def local_sgd(kernel: Kernel) -> list[dict[str, Any]]:
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = kernel.prepare(model, optimizer)
    steps = []
    with LocalSGD(accelerator=kernel, model=model, local_sgd_steps=3, enabled=True) as sgd:
        for step in range(1, 7):
            x, y = batch(kernel, step)
            kernel.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            sgd.step()
            steps.append({"step": step, "checksum": checksum(model)})
    return steps


def triggers(kernel: Kernel) -> list[bool]:
    seen = [kernel.check_trigger()]
    if kernel.process_index == 1:
        kernel.set_trigger()
    seen.append(kernel.check_trigger())  # every rank sees rank 1's trigger
    seen.append(kernel.check_trigger())  # and it was reset
    return seen


def profile(kernel: Kernel) -> dict[str, Any]:
    ready: list[int] = []
    handler = ProfileKwargs(
        schedule_option=dict(wait=1, warmup=1, active=2, repeat=1),
        record_shapes=True,
        on_trace_ready=lambda prof: ready.append(kernel.process_index),
        output_trace_dir=str(OUT / "traces"),
        activities=["cpu"],
    )
    model = nn.Linear(8, 8)
    with kernel.profile(handler) as prof:
        for _ in range(6):
            model(torch.randn(4, 8)).sum().backward()
            prof.step()
    return {"on_trace_ready": ready}


def torch_alone(kernel: Kernel, hook: str, wrapper: str, state_option: dict[str, Any]) -> str | None:
    """The same hook on a plain DistributedDataParallel, without accel: the error torch gives, if any. The test
    expects from accel what this torch does (a hook torch runs trains; one torch fails with is refused)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "no":
        return None
    module = powerSGD_hook if "power_sgd" in hook else default_hooks
    function = getattr(
        module,
        {"power_sgd": "powerSGD_hook", "batched_power_sgd": "batched_powerSGD_hook"}.get(hook, f"{hook}_compress_hook"),
    )
    if wrapper:
        function = getattr(default_hooks, f"{wrapper}_compress_wrapper")(function)
    state = powerSGD_hook.PowerSGDState(None, **state_option) if "power_sgd" in hook else None
    model = nn.parallel.DistributedDataParallel(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        model.register_comm_hook(state=state, hook=function)
        for step in range(1, 6):
            x, y = batch(kernel, step)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def comm_hooks() -> dict[str, Any]:
    cases = {
        "no": {},
        "fp16": {},
        "bf16": {},
        "power_sgd+bf16": {"matrix_approximation_rank": 1},
        "power_sgd": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
        "batched_power_sgd": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
        "power_sgd+fp16": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    }
    out: dict[str, Any] = {}
    for name, state in cases.items():
        hook, _, wrapper = name.partition("+")
        handler = DistributedDataParallelKwargs(
            comm_hook=DDPCommunicationHookType(hook),
            comm_wrapper=DDPCommunicationHookType(wrapper or "no"),
            comm_state_option=state,
            static_graph=name == "no",  # the other DDP fields reach DistributedDataParallel too
            gradient_as_bucket_view=name == "no",
            broadcast_buffers=name != "no",
        )
        kernel = Kernel(kwargs_handlers=[handler])
        model = net()
        before = checksum(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses: list[float] = []
        ddp = None
        try:
            model, optimizer = kernel.prepare(model, optimizer)
            ddp = kernel._inner[id(model)]
            for step in range(1, 6):
                x, y = batch(kernel, step)
                loss = nn.functional.mse_loss(model(x), y)
                kernel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            error = None
        except Exception as exc:  # recorded: the test checks accel's one-line refusal
            error = f"{type(exc).__name__}: {exc}"
        hooks = [getattr(h, "__qualname__", repr(h)) for h, _ in getattr(ddp, "_comm_hooks", [])]
        out[name] = {
            "hooks": hooks,
            "before": before,
            "after": checksum(model),
            "losses": losses,
            "error": error,
            "torch_alone": torch_alone(kernel, hook, wrapper, state),
            "settings": [kernel.settings["ddp_comm_hook"], kernel.settings["ddp_comm_wrapper"]],
            "ddp": None
            if ddp is None
            else [bool(ddp.static_graph), ddp.gradient_as_bucket_view, ddp.broadcast_buffers],
        }
    return out


def main() -> None:
    kernel = Kernel()
    set_seed(42)
    same = draws()
    set_seed(42, device_specific=True)
    specific = draws()
    record = {
        "rank": kernel.process_index,
        "same": same,
        "specific": specific,
        "bar_disabled": tqdm(range(3)).disable,
        "bar_everywhere": tqdm(range(3), main_process_only=False).disable,
        "triggers": triggers(kernel),
        "local_sgd": local_sgd(kernel),
        "profile": profile(kernel),
    }
    record["comm_hooks"] = comm_hooks()
    (OUT / f"rank{kernel.process_index}.json").write_text(json.dumps(record))
    kernel.end_training()


if __name__ == "__main__":
    main()
