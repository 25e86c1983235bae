"""Worker for tests/test_accelerate_semantics.py: ``Kernel(parallelism_config=...)`` on any launcher, and a mesh
checkpoint loaded into runs without a sharding strategy.

    semantics_mesh.py save OUT        Kernel(parallelism_config={"dp_shard_size": N}): 2 AdamW steps, save_state
                                      to OUT/ckpt, the full parameters and optimizer state to OUT/saved.safetensors
    semantics_mesh.py load CKPT OUT   Kernel() (one plain process or DDP): load_sharded(CKPT), the same files as
                                      OUT/loaded.safetensors
    semantics_mesh.py heads OUT       Kernel(parallelism_config={"tp_size": N}) with a Llama of 1 key/value head

Every process writes OUT/rank{i}.json (the active components).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from accel import Kernel


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def full_state(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The whole parameters and AdamW moments by parameter name (gathered where they are sharded)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    inner = getattr(optimizer, "optimizer", optimizer)
    out = {f"model.{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
    for name, state in get_optimizer_state_dict(model, inner, options=options)["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"optim.{name}.{key}"] = torch.as_tensor(state[key]).detach().clone().reshape(-1)
    return out


def report(kernel: Kernel, out: Path, **extra: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{c.name}:{c.role}" for c in kernel.components]
    (out / f"rank{kernel.process_index}.json").write_text(json.dumps({"components": names, **extra}))


def main() -> None:
    mode = sys.argv[1]
    if mode == "save":
        out = Path(sys.argv[2])
        import os

        kernel = Kernel(parallelism_config={"dp_shard_size": int(os.environ["WORLD_SIZE"])})
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, optimizer = kernel.prepare(model, optimizer)
        for step in range(2):
            x = torch.full((2, 4), float(kernel.process_index + step))
            kernel.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        kernel.save_state(out / "ckpt")
        state = full_state(model, optimizer)
        if kernel.is_main_process:
            save_file(state, str(out / "saved.safetensors"))
        report(kernel, out)
    elif mode == "load":
        from accel_parallel import load_sharded

        ckpt, out = Path(sys.argv[2]), Path(sys.argv[3])
        kernel = Kernel()
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, optimizer = kernel.prepare(model, optimizer)
        load_sharded(kernel, ckpt, model=model, optimizer=optimizer)
        state = full_state(model, optimizer)
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / f"loaded{kernel.process_index}.safetensors"))
        report(kernel, out)
    elif mode == "heads":
        import os

        from transformers import LlamaConfig, LlamaForCausalLM

        tp = int(os.environ["WORLD_SIZE"])
        kernel = Kernel(parallelism_config={"tp_size": tp})
        config = LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=1,
        )
        kernel.prepare(LlamaForCausalLM(config))
    kernel.end_training()


if __name__ == "__main__":
    main()
