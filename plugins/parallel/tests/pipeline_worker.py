"""Worker for plugins/parallel/tests/test_pipeline.py: trains an MLP (a ``layers`` nn.Sequential), a tiny Qwen2 and a tiny GPT-NeoX (built from
configs; GPT-NeoX with ``--models``) with pipeline parallelism under whatever mesh ``accel launch --plugin parallel`` gives it, or alone (``--ref``,
the kernel only). The loop is the same either way: ``loss = model(inputs, labels=targets).loss``,
``kernel.backward(loss)``, clipping, ``optimizer.step()``.

Usage: pipeline_worker.py OUT [--ref] [--models mlp,qwen2,neox] [--save-at K] [--resume CKPT] [--load CKPT] [--no-eval]
       pipeline_worker.py OUT --cases JSON (several runs, one after the other: see parallel_worker.run_cases)

Writes OUT/result.json (losses, clipping norms) and OUT/<model>.safetensors (final full parameters, and
<model>_at_save.safetensors at the save step). ``--load`` also builds fresh models, loads a checkpoint's models and
optimizers into them with ``accel_parallel.load_sharded`` and writes OUT/<model>_loaded.safetensors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from parallel_worker import (  # the same batches and gathered state, the same cases
    GLOBAL_BATCH,
    SEQ,
    STEPS,
    VOCAB,
    full_state,
    mesh_of,
    run,
)
from safetensors.torch import save_file
from torch import nn
from torch.distributed._composable.contract import _get_registry
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel

KEYS = {
    "mlp": ("model", "optimizer"),
    "qwen2": ("model_1", "optimizer_1"),
    "tied": ("model_2", "optimizer_2"),
}  # the checkpoint's item names


def block(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU())


class MLP(nn.Module):
    """Five layers in ``layers``; HF-style: ``forward(x, labels=...)`` returns an output with ``.loss``."""

    _tp_plan = {"layers.0.0": "colwise", "layers.1.0": "rowwise", "layers.2.0": "colwise", "layers.3.0": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(block(16, 32), block(32, 16), block(16, 32), block(32, 16), nn.Linear(16, 4))

    def loss_function(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, labels)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        out = self.layers(x)
        return SimpleNamespace(logits=out, loss=None if labels is None else self.loss_function(out, labels))


#: the tiny decoders' sizes (4 layers, 4 heads)
DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
    "attn_implementation": "sdpa",
}


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**DECODER, num_key_value_heads=2))


def neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(**DECODER))


def tied() -> nn.Module:
    """A tiny Qwen2 whose LM head is its input embedding (``tie_word_embeddings=True``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**DECODER, "tie_word_embeddings": True}, num_key_value_heads=2))


BUILD = {"mlp": MLP, "qwen2": qwen2, "neox": neox, "tied": tied}


def data() -> dict[str, TensorDataset]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH * STEPS, 16, generator=g)
    y = torch.randint(0, 4, (GLOBAL_BATCH * STEPS,), generator=g)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=g)
    return {"mlp": TensorDataset(x, y), "qwen2": TensorDataset(ids, ids)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--models", default="mlp,qwen2,tied")
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--cases", default="", help="JSON [[name, Kernel options, worker arguments], ...]")
    return ap


def main() -> None:
    run(parser(), train)  # as parallel_worker: 2 batches per optimizer step, --cases


def train(kernel: Kernel, args: argparse.Namespace) -> None:
    out = Path(args.out)
    names = args.models.split(",")
    torch.manual_seed(0)
    models = {k: BUILD[k]() for k in BUILD}  # all built, so that the random initial weights do not depend on --models
    models = {k: models[k] for k in names}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    per_process = GLOBAL_BATCH // kernel.data_parallel_size
    datasets = data()
    datasets["neox"] = datasets["tied"] = datasets["qwen2"]
    prepared = {
        k: kernel.prepare(models[k], optimizers[k], DataLoader(datasets[k], batch_size=per_process)) for k in models
    }
    start = 0
    if args.resume:
        kernel.load_state(args.resume)
        start = args.save_at
    res: dict[str, Any] = {
        "world": kernel.num_processes,
        "dp": kernel.data_parallel_size,
        "plugins": [c.name for c in kernel.components],
        "local_numel": {
            k: sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in m.parameters())
            for k, (m, _, _) in prepared.items()
        },
    }
    res["mesh"] = mesh_of(kernel)
    # layers of this process that recompute their activations in backward (torch's composable checkpoint)
    res["checkpointed"] = {
        k: sum("checkpoint" in (_get_registry(m) or {}) for m in models[k].modules()) for k in prepared
    }
    res["schedule"] = next((c.plan.pp_schedule for c in kernel.components if hasattr(c, "plan")), None)
    # the sequence length a decoder layer's second norm computes on here (the whole sequence, or with sequence
    # parallelism its 1/tp shard): the first one this process holds
    res["norm_seq"] = {}

    def watch(key: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            res["norm_seq"].setdefault(key, (x.to_local() if hasattr(x, "to_local") else x).shape[1])

        return hook

    for key, model in models.items():
        norm = next((m for n, m in model.named_modules() if n.endswith("post_attention_layernorm")), None)
        if norm is not None:
            norm.register_forward_pre_hook(watch(key))
    losses: dict[str, list[float]] = {k: [] for k in prepared}
    norms: dict[str, list[float]] = {k: [] for k in prepared}
    iters = {k: iter(dl) for k, (_, _, dl) in prepared.items()}
    for step in range(start, STEPS):
        with kernel.accumulate(*(m for m, _, _ in prepared.values())):
            for key, (model, optimizer, _) in prepared.items():
                inputs, targets = next(iters[key])
                loss = model(inputs, labels=targets).loss
                kernel.backward(loss)
                if kernel.sync_gradients:
                    norms[key].append(float(kernel.clip_grad_norm_(model.parameters(), 1.0)))
                optimizer.step()
                optimizer.zero_grad()
                losses[key].append(float(kernel.reduce(loss.detach(), "mean")))
        if args.save_at and step + 1 == args.save_at and not args.resume:
            kernel.save_state(str(out / "ckpt"))
            for key, (model, _, _) in prepared.items():
                state = full_state(kernel, model)
                if kernel.is_main_process:
                    save_file(state, str(out / f"{key}_at_save.safetensors"))
    res["losses"], res["norms"] = losses, norms
    # evaluation: forward only (the pipeline's eval); the loss of the first batch, and the accuracy of the
    # predictions (argmax of the logits) over the whole data, gathered with gather_for_metrics
    res["eval_losses"], res["accuracy"] = {}, {}
    for key, (model, _, loader) in prepared.items() if not args.no_eval else ():
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for i, (inputs, targets) in enumerate(loader):
                output = model(inputs, labels=targets)
                if i == 0:
                    res["eval_losses"][key] = float(kernel.reduce(output.loss, "mean"))
                if output.logits is None:  # --parallelism_config_pp_eval_logits false
                    continue
                preds, labels = kernel.gather_for_metrics((output.logits.argmax(-1), targets))
                correct, total = correct + int((preds == labels).sum()), total + labels.numel()
        res["accuracy"][key] = correct / total if total else None
        model.train()
    out.mkdir(parents=True, exist_ok=True)
    for key, (model, _, _) in prepared.items():
        state = full_state(kernel, model)
        if kernel.is_main_process:
            save_file(state, str(out / f"{key}.safetensors"))
    if args.load:  # fresh models (other initial weights), prepared on this run's mesh, loaded from any mesh
        from accel_parallel import load_sharded

        torch.manual_seed(123)
        for key in names:
            model = BUILD[key]()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, optimizer = kernel.prepare(model, optimizer)
            load_sharded(
                kernel, args.load, model=model, optimizer=optimizer, model_key=KEYS[key][0], optimizer_key=KEYS[key][1]
            )
            state = full_state(kernel, model)
            if kernel.is_main_process:
                save_file(state, str(out / f"{key}_loaded.safetensors"))
    if kernel.is_main_process:
        (out / "result.json").write_text(json.dumps(res))
    kernel.end_training()


if __name__ == "__main__":
    main()
