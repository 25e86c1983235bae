"""Worker for plugins/parallel/tests/test_parallel.py: trains an MLP and a tiny Llama (built from a config) on one global batch per
step, through the Kernel, under whatever mesh ``accel launch --plugin parallel`` gives it (or alone, ``--ref``).

Usage: parallel_worker.py OUT [--ref] [--save-at K] [--resume CKPT] [--load CKPT]
       parallel_worker.py OUT --cases JSON (several runs, one after the other: see run_cases)

Writes OUT/result.json (losses, parameter types, gathered evaluation indices, local sizes) and OUT/<model>.safetensors
(final full parameters, and <model>_at_save.safetensors at the save step). ``--resume`` loads a checkpoint saved by
``--save-at`` and trains the remaining steps; ``--load`` then also builds fresh models, loads a checkpoint's models
and optimizers into them with ``accel_parallel.load_sharded`` (saved on any mesh) and writes
OUT/<model>_loaded.safetensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel

STEPS = 6
GLOBAL_BATCH = 8
SEQ = 8
VOCAB = 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    #: its tensor-parallel plan, where Hugging Face models keep theirs
    _tp_plan = {"fc1": "colwise", "fc2": "rowwise"}


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH * STEPS, 16, generator=g)
    y = torch.randint(0, 4, (GLOBAL_BATCH * STEPS,), generator=g)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=g)
    return TensorDataset(x, y), TensorDataset(ids)


def full_state(kernel: Kernel, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().float().clone() for k, v in kernel.get_state_dict(model).items()}  # tied: copies


def mesh_of(kernel: Kernel) -> dict[str, int]:
    """The DeviceMesh the run's strategy built (dimension: size), or {} without one."""
    strategy = next((c for c in kernel.components if hasattr(c, "mesh")), None)
    return dict(zip(strategy.mesh.mesh_dim_names, strategy.mesh.shape, strict=True)) if strategy else {}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--cases", default="", help="JSON [[name, Kernel options, worker arguments], ...]")
    return ap


def main() -> None:
    run(parser(), train)


def run(ap: argparse.ArgumentParser, body: Any) -> None:
    """``body(kernel, args)`` once, or for each of ``--cases``; 2 batches per optimizer step: no_sync on the first."""
    args = ap.parse_args()
    if not args.cases:
        body(Kernel(gradient_accumulation_steps=2), args)
        return
    run_cases(json.loads(args.cases), Path(args.out), ap, body)


def run_cases(cases: list[Any], out: Path, ap: argparse.ArgumentParser, body: Any) -> None:
    """Several meshes in one launch, one after the other: each case is a Kernel of its own (the launch's settings,
    with the case's options on top: other sizes, schedule...) on the one process group of the launch, which this
    worker starts (so no case's ``end_training`` ends it); case NAME writes OUT/NAME. A failing case stops the
    launch: the cases before it have written their results, the later ones have none."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for name, options, argv in cases:
        try:
            body(Kernel(gradient_accumulation_steps=2, **options), ap.parse_args([str(out / name), *argv]))
        except BaseException:
            print(f"case {name} failed; the later cases did not run", file=sys.stderr, flush=True)
            raise
    dist.destroy_process_group()


def train(kernel: Kernel, args: argparse.Namespace) -> None:
    out = Path(args.out)
    torch.manual_seed(0)
    models = {"mlp": MLP(), "llama": llama()}
    tp = kernel.num_processes // kernel.data_parallel_size
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    per_process = GLOBAL_BATCH // kernel.data_parallel_size
    mlp_data, llama_data = data()
    loaders = {
        "mlp": DataLoader(mlp_data, batch_size=per_process),
        "llama": DataLoader(llama_data, batch_size=per_process),
    }
    res: dict = {
        "world": kernel.num_processes,
        "dp": kernel.data_parallel_size,
        "tp": tp,
        "plugins": [c.name for c in kernel.components],
    }
    prepared = {key: kernel.prepare(models[key], optimizers[key], loaders[key]) for key in models}
    keys = {"mlp": ("model", "optimizer"), "llama": ("model_1", "optimizer_1")}  # the checkpoint's item names
    start = 0
    if args.resume:
        kernel.load_state(args.resume)
        start = args.save_at
    res["mesh"] = mesh_of(kernel)
    p0 = next(prepared["llama"][0].parameters())
    res["param_type"] = type(p0.data if not hasattr(p0, "_local_tensor") else p0).__name__
    res["local_numel"] = {
        k: sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in m.parameters())
        for k, (m, _, _) in prepared.items()
    }
    res["total_numel"] = {k: sum(p.numel() for p in m.parameters()) for k, (m, _, _) in prepared.items()}
    res["optimizer_params_are_model_params"] = all(
        {id(p) for g in o.param_groups for p in g["params"]} == {id(p) for p in m.parameters()}
        for m, o, _ in prepared.values()
    )
    losses: dict[str, list[float]] = {k: [] for k in prepared}
    norms: dict[str, list[float]] = {k: [] for k in prepared}
    iters = {k: iter(dl) for k, (_, _, dl) in prepared.items()}
    for step in range(start, STEPS):
        with kernel.accumulate(*(m for m, _, _ in prepared.values())):  # one accumulation step for both
            for key, (model, optimizer, _) in prepared.items():
                batch = next(iters[key])
                if key == "mlp":
                    x, y = batch
                    loss = nn.functional.cross_entropy(model(x), y)
                else:
                    (ids,) = batch
                    loss = model(input_ids=ids, labels=ids).loss
                kernel.backward(loss)
                if kernel.sync_gradients:
                    norms[key].append(float(kernel.clip_grad_norm_(model.parameters(), 1e9)))
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
    # evaluation: every sample counted once by gather_for_metrics, whatever the mesh (10 samples: uneven shards)
    eval_loader = kernel.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    seen: list[int] = []
    for (idx,) in eval_loader:
        seen += kernel.gather_for_metrics(idx).tolist()
    res["eval_seen"] = seen
    res["eval_seen_objects"] = []
    for (idx,) in eval_loader:
        res["eval_seen_objects"] += kernel.gather_for_metrics(idx.tolist(), use_gather_object=True)
    for key, (model, _, _) in prepared.items():
        state = full_state(kernel, model)
        if kernel.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            save_file(state, str(out / f"{key}.safetensors"))
    if args.load:  # fresh models (other initial weights), prepared on this run's mesh, loaded from any mesh
        from accel_parallel import load_sharded

        torch.manual_seed(123)
        for key, build in (("mlp", MLP), ("llama", llama)):
            model = build()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, optimizer = kernel.prepare(model, optimizer)
            load_sharded(
                kernel, args.load, model=model, optimizer=optimizer, model_key=keys[key][0], optimizer_key=keys[key][1]
            )
            state = full_state(kernel, model)
            if kernel.is_main_process:
                save_file(state, str(out / f"{key}_loaded.safetensors"))
    if kernel.is_main_process:
        (out / "result.json").write_text(json.dumps(res))
    kernel.end_training()


if __name__ == "__main__":
    main()
