"""Train the digits example's CNN through accel with the ipex plugin and write a JSON report of what IPEX did.

    accel launch --plugin ipex plugins/ipex/tests/ipex_train.py --out report.json [--optimizer adam] [--epochs 2]
    (or ``--in-process``-style: ``run(...)`` from a test, with ``Kernel(plugins=["ipex"])``)

The report holds the per-epoch mean loss, the accuracy, the modules and optimizer IPEX produced (types, fused step,
parameter dtypes, master weights), the state dict ``get_state_dict``/``save_model`` give, and a save_state/load_state
round trip. The tests assert on it; nothing here decides whether IPEX worked.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from train_digits import Net, datasets  # noqa: E402  (the example's model and data, unchanged)

from accel import Kernel, load_model  # noqa: E402

OPTIMIZERS = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr * 10, momentum=0.9),
}


def describe_optimizer(opt: torch.optim.Optimizer) -> dict[str, Any]:
    step = opt.step
    wrappers = list(getattr(opt, "params_attr", {}).values())
    return {
        "type": type(opt).__name__,
        "fused": bool(getattr(opt, "fused", False)),
        "step": f"{getattr(step, '__module__', '')}.{getattr(step, '__qualname__', '')}",
        "has_original_step": hasattr(opt, "_original_step"),
        "params_attr": len(wrappers),
        "split_master": sum(1 for w in wrappers if getattr(w, "parameter_trail", None) is not None),
        "fp32_master": sum(
            1
            for w in wrappers
            if getattr(w, "master_parameter", None) is not None and w.master_parameter.dtype == torch.float32
        ),
        "param_dtypes": sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}),
    }


def run(
    out: Path,
    optimizer_name: str = "adam",
    epochs: int = 2,
    mixed_precision: str | None = None,
    plugins: list[str] | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    torch.manual_seed(0)
    kernel = Kernel(plugins=plugins, mixed_precision=mixed_precision)
    train_ds, test_ds = datasets()
    train_dl = DataLoader(train_ds, batch_size=32, shuffle=True)
    test_dl = DataLoader(test_ds, batch_size=64)
    model = Net()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters(), 3e-3)
    model, optimizer, train_dl, test_dl = kernel.prepare(model, optimizer, train_dl, test_dl)
    inner = kernel.unwrap_model(model)
    report: dict[str, Any] = {
        "kernel": repr(kernel),
        "components": [f"{c.name}:{c.role}" for c in kernel.components],
        "num_processes": kernel.num_processes,
        "mixed_precision": kernel.mixed_precision,
        "device": str(kernel.device),
        "wrappers": [type(m).__name__ for m in (model, getattr(model, "module", None)) if m is not None],
        "modules": [type(m).__name__ for m in inner.modules()],
        "module_classes": sorted({f"{type(m).__module__}.{type(m).__name__}" for m in inner.modules()}),
        "optimizer": describe_optimizer(optimizer.optimizer),
        "losses": [],
    }
    for _ in range(epochs):
        model.train()
        total, count = torch.zeros(()), 0
        for x, y in train_dl:
            loss = nn.functional.cross_entropy(model(x), y)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach().float()
            count += 1
        report["losses"].append(float(kernel.reduce(total / count, "mean")))
    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for x, y in test_dl:
            pred, y = kernel.gather_for_metrics((model(x).argmax(-1), y))
            correct += int((pred == y).sum())
            seen += len(y)
    report["accuracy"] = correct / seen
    # the model's own weights (IPEX adds empty placeholder parameters to prepacked modules; not counted)
    report["param_dtypes"] = sorted(
        {str(p.dtype) for n, p in inner.named_parameters() if "_ipex_module_empty" not in n}
    )

    # Weights as the user gets them: plain fp32 tensors under the model's own names, loadable into a fresh Net.
    state = {k: v.detach().clone() for k, v in kernel.get_state_dict(model).items()}
    report["state_dict"] = {k: [str(v.dtype), list(v.shape)] for k, v in state.items()}
    sums = kernel.gather_object(tuple(float(v.double().sum()) for v in state.values()))
    report["weights_same_on_every_process"] = all(s == sums[0] for s in sums)
    plain = Net()
    plain.load_state_dict(state)
    report["state_dict_loads"] = True
    # bf16 weights with fp32 master weights: the state dict holds values that bf16 cannot represent (a model
    # trained with bf16 weights alone could only give bf16 values).
    report["state_dict_finer_than_bf16"] = any(
        bool((v != v.to(torch.bfloat16).float()).any()) for v in state.values() if v.is_floating_point()
    )
    x = test_ds.tensors[0][:64]
    with torch.no_grad():
        plain.eval()
        report["plain_vs_prepared_max_diff"] = float((plain(x) - model(x).float()).abs().max())

    if workdir is not None:
        weights = workdir / "weights"
        kernel.save_model(model, weights)
        loaded = load_model(Net(), weights)
        report["save_model_equal"] = all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
        ckpt = kernel.save_state(workdir / "ckpt")
        # a copy: torch's state_dict holds the live state tensors (IPEX's, when it prepacked, held unpacked copies)
        saved_opt = copy.deepcopy(optimizer.state_dict())
        model.train()
        for i, (x, y) in enumerate(train_dl):  # move away from the checkpoint
            kernel.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if i == 3:
                break
        moved = kernel.get_state_dict(model)
        report["moved_after_save"] = any(not torch.equal(moved[k], state[k]) for k in state)
        kernel.load_state(ckpt)
        back = kernel.get_state_dict(model)
        report["load_state_restores_weights"] = all(torch.equal(back[k], state[k]) for k in state)
        after = optimizer.state_dict()
        report["load_state_restores_optimizer"] = all(
            torch.equal(torch.as_tensor(a), torch.as_tensor(b))
            for i in saved_opt["state"]
            for key, a in saved_opt["state"][i].items()
            for b in [after["state"][i][key]]
        )
    kernel.end_training()
    if kernel.is_main_process:
        out.write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    run(args.out, args.optimizer, args.epochs, workdir=args.workdir)


if __name__ == "__main__":
    main()
