"""Worker of :class:`accel.testing.conformance.StrategyConformance`'s training test.

``accel launch -n N [--plugin NAME] -m accel.testing.strategy_check OUT_DIR [--model pipeline]``: trains a linear
model (or, with ``--model pipeline``, a four-layer linear stack a pipeline-parallel strategy splits into stages) on a fixed
data set with gradient accumulation, exercises the collectives, and writes ``OUT_DIR/process<i>.json``. Built so
that the result does not depend on how batches are spread over processes: one optimizer step per epoch whose
gradient is the full-batch gradient, so the final weights equal :func:`reference_weights`.

It also records which samples the process trained on in the first epoch (each process must get its own share),
after each micro-batch's backward the gradients the user's module holds (every process sees other
samples, so they differ between processes until a step synchronises them), and whether ``unwrap_model`` gives back
the very module object that was prepared.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SAMPLES = 32
FEATURES = 4
EPOCHS = 3
LR = 0.1
ACCUMULATION = 2


def make_data() -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


#: ``--model`` values: ``linear`` (the default, one nn.Linear) and ``pipeline`` (:func:`stack`)
MODELS = ("linear", "pipeline")


def stack() -> Any:
    """Four linear layers in a ``layers`` nn.Sequential (what a pipeline splits into stages: up to 4),
    Hugging Face-style: ``forward(x, labels=...)`` returns an output with ``.loss`` and ``loss_function(output,
    labels)`` is the MSE the last stage computes; ``_tp_plan`` (colwise, rowwise pairs) for a tensor-parallel
    dimension. Linear, so full-batch gradient descent stays as exact as the single Linear's."""
    from types import SimpleNamespace

    import torch

    class Stack(torch.nn.Module):
        _tp_plan = {"layers.0": "colwise", "layers.1": "rowwise", "layers.2": "colwise", "layers.3": "rowwise"}

        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(
                *(torch.nn.Linear(FEATURES, FEATURES) for _ in range(3)), torch.nn.Linear(FEATURES, 1)
            )

        def loss_function(self, out: Any, labels: Any) -> Any:
            return torch.nn.functional.mse_loss(out, labels)

        def forward(self, x: Any, labels: Any = None) -> Any:
            out = self.layers(x)
            return SimpleNamespace(logits=out, loss=None if labels is None else self.loss_function(out, labels))

    return Stack()


def make_model(model: str = "linear") -> Any:
    import torch

    torch.manual_seed(0)
    return stack() if model == "pipeline" else torch.nn.Linear(FEATURES, 1)


def reference_state(model: str = "linear") -> dict[str, list[float]]:
    """Full-batch gradient descent on one process, without accel: the final parameters, by name."""
    import torch

    x, y = make_data()
    net = make_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(EPOCHS):
        opt.zero_grad()
        out = net(x) if model == "linear" else net(x).logits
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()
    return {name: [float(v) for v in p.detach().flatten()] for name, p in net.named_parameters()}


def reference_weights(model: str = "linear") -> list[float]:
    """:func:`reference_state` flattened: what every strategy must reproduce."""
    return [v for values in reference_state(model).values() for v in values]


def whole(tensor: Any) -> Any:
    """``tensor`` itself, or all of it where it is a shard (a ``DTensor``: a collective, so every process calls
    this at the same point)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_gradients(module: Any) -> list[float] | None:
    """The gradients ``module``'s parameters hold now, flattened (a sharded ``DTensor`` is gathered whole: every
    process calls this at the same point), or None where a parameter has none (a strategy may keep gradients in
    its own buffers between synchronisations)."""
    import torch

    grads = []
    for param in module.parameters():
        grad = param.grad
        if grad is None:
            return None
        grads.append(whole(grad).detach().float().flatten().cpu())
    return [float(v) for v in torch.cat(grads)] if grads else None


def main(argv: list[str]) -> int:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Kernel

    out = argv[0]
    kind = argv[argv.index("--model") + 1] if "--model" in argv else "linear"
    if kind not in MODELS:
        raise SystemExit(f"strategy_check --model {kind}: expected one of {', '.join(MODELS)}")
    pipeline = kind == "pipeline"
    kernel = Kernel(gradient_accumulation_steps=ACCUMULATION)
    n = kernel.num_processes
    # with pipeline parallelism the processes of one pipeline read the same batches: the data is sharded over the
    # data-parallel dimension only
    shards = kernel.data_parallel_size if pipeline else n
    if SAMPLES % (shards * ACCUMULATION):
        raise SystemExit(f"strategy_check needs a process count dividing {SAMPLES // ACCUMULATION}, got {shards}")
    x, y = make_data()
    # ACCUMULATION micro-batches per process per epoch: each optimizer step sees every sample once.
    loader = DataLoader(TensorDataset(x, y), batch_size=SAMPLES // (shards * ACCUMULATION))
    # uneven batches test even_batches + gather_for_metrics; a pipeline splits each batch into microbatches, so
    # its batches stay even (4 rows: a multiple of the default microbatch count of 2 or 4 stages)
    evaluation = DataLoader(TensorDataset(x, y), batch_size=4 if pipeline else 5)
    original = make_model(kind)
    user_class = type(original)  # a sharding strategy may swap in a subclass of it (FSDP2's FSDPLinear), in place
    initial_named = {name: [float(v) for v in p.detach().flatten()] for name, p in original.named_parameters()}
    initial = [v for values in initial_named.values() for v in values]
    optimizer = torch.optim.SGD(original.parameters(), lr=LR)
    model, optimizer, loader, evaluation = kernel.prepare(original, optimizer, loader, evaluation)
    steps = 0
    micro_steps = []  # per micro-batch: did it synchronise, and the gradients the user's module held after backward
    epoch_targets: list[float] = []  # the samples (their targets) this process trained on in the first epoch
    for epoch in range(EPOCHS):
        for xb, yb in loader:
            if epoch == 0:
                epoch_targets.extend(float(v) for v in yb.flatten().cpu())
            with kernel.accumulate(model):
                if pipeline:  # the prepared model runs the pipeline step and returns the loss
                    loss = model(xb, labels=yb).loss
                else:
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                kernel.backward(loss)
                micro_steps.append(
                    {"sync": kernel.sync_gradients, "grads": local_gradients(kernel.unwrap_model(model))}
                )
                optimizer.step()
                optimizer.zero_grad()
                steps += int(kernel.sync_gradients)
    targets = []
    model.eval()
    with torch.no_grad():
        for xb, yb in evaluation:
            model(xb, labels=yb) if pipeline else model(xb)
            targets.append(kernel.gather_for_metrics(yb).cpu())
    unwrapped = kernel.unwrap_model(model)
    same_outputs = None  # a pipeline process holds its stage's layers only: the module cannot compute alone
    if not pipeline:
        with torch.no_grad():  # the module unwrap_model returns is the one that was trained: it computes the same
            probe = x[:4].to(kernel.device)
            same_outputs = bool(torch.allclose(model(probe).float(), unwrapped(probe).float(), rtol=1e-4, atol=1e-5))
    named = {name: whole(p.detach()).float().flatten().cpu() for name, p in unwrapped.named_parameters()}
    weights = torch.cat(list(named.values()))
    state_dict_keys = sorted(kernel.get_state_dict(model).keys())  # on every process: gathering may be a collective
    rank = torch.tensor([float(kernel.process_index + 1)], device=kernel.device)
    shared = torch.full((2,), float(kernel.process_index), device=kernel.device)
    report = {
        "process_index": kernel.process_index,
        "num_processes": n,
        "model": kind,
        "data_parallel_size": shards,
        "named_weights": {name: [float(v) for v in w] for name, w in named.items()},
        "local_process_index": kernel.local_process_index,
        "is_main_process": kernel.is_main_process,
        "device": str(kernel.device),
        "optimizer_steps": steps,
        "weights": [float(v) for v in weights],
        "unwrapped_type": type(unwrapped).__name__,
        "unwrapped_is_original": unwrapped is original and isinstance(unwrapped, user_class),
        "unwrapped_computes_like_prepared": same_outputs,
        "initial_weights": initial,
        "initial_named_weights": initial_named,
        "micro_steps": micro_steps,
        "epoch_targets": epoch_targets,
        "all_weights": [list(map(float, w)) for w in kernel.gather_object([weights.tolist()])],
        "gathered_targets": sorted(float(v) for v in torch.cat(targets).flatten()),
        "reduce_sum": float(kernel.reduce(rank, "sum").item()),
        "gather_ranks": [float(v) for v in kernel.gather(rank).cpu()],
        "broadcast": [float(v) for v in kernel.broadcast(shared, from_process=0).cpu()],
        "state_dict_keys": state_dict_keys if kernel.is_main_process else [],
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"process{kernel.process_index}.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh)
    kernel.wait_for_everyone()
    kernel.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
