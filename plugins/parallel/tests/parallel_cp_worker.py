"""Worker for plugins/parallel/tests/test_parallel_cuda.py: causal self-attention trained with its sequence split over the ``cp``
mesh dimension (``accel_parallel.context_parallel``), or alone on the whole sequence (``--ref``).

Usage: parallel_cp_worker.py OUT [--ref]; writes OUT/result.json with the losses (mean over all processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from accel import Kernel

B, S, D, H, V, STEPS = 2, 64, 32, 4, 50, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, s, 3, H, D // H).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.head(out.transpose(1, 2).reshape(b, s, D))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ref", action="store_true")
    args = ap.parse_args()
    kernel = Kernel()
    torch.manual_seed(0)
    model = Attention()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = kernel.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, V, (B, S + 1), generator=g).to(kernel.device)
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        if args.ref:
            ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        else:
            from accel_parallel import context_parallel

            ctx = context_parallel(kernel, buffers=[inputs, labels], buffer_seq_dims=[1, 1])
        with ctx:  # the forward and backward of the batch, each process on its part of the sequence
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
            kernel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(kernel.reduce(loss.detach(), "mean")))
    if kernel.is_main_process:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(
            json.dumps({"losses": losses, "world": kernel.num_processes, "device": str(kernel.device)})
        )
    kernel.end_training()


if __name__ == "__main__":
    main()
