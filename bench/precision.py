"""Precision and compile benchmark on a small transformer-ish model, through the plugins (Kernel + prepare).

1. Training steps per second for mixed_precision no (fp32), bf16 and fp16 (accel-plugin-amp).
2. torch.compile with inductor (accel-plugin-dynamo): the first step (compile) and the steady steps per second
   after warm-up, against eager; how many steps pay back the compile.

    python bench/precision.py                          # print the tables
    python bench/precision.py --write docs/benchmarks.md   # also replace the "Precision and compile" section

Inductor's cache goes to a fresh temporary directory, so the compile time is a cold one.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SECTION = "## Precision and compile (CPU)"


def build_model() -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        """Embedding, 2 pre-norm transformer encoder layers (d=128, 4 heads, ffn 512), LM head."""

        def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    dim, 4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(layers)
            )
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return TinyLM()


class Trainer:
    """One prepared model + optimizer on its own Kernel; ``step()`` is one training step."""

    def __init__(self, batch: int, seq: int, **kernel_args: Any) -> None:
        import torch

        from accel import Kernel

        torch.manual_seed(0)
        self.kernel = Kernel(**kernel_args)
        model = build_model()
        self.model, self.opt = self.kernel.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 1000, (batch, seq + 1), generator=gen)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]
        self.losses: list[float] = []
        self.rates: list[float] = []
        start = time.perf_counter()
        self.step()
        self.first_s = time.perf_counter() - start  # includes compiling, for a compiled model

    def step(self) -> None:
        from torch import nn

        loss = nn.functional.cross_entropy(self.model(self.x).flatten(0, 1), self.y.flatten())
        self.kernel.backward(loss)
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())

    def timed(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.rates.append(steps / (time.perf_counter() - start))

    @property
    def steps_per_s(self) -> float:
        return statistics.median(self.rates)


def measure(
    configs: dict[str, dict[str, Any]], steps: int, warmup: int, rounds: int, batch: int, seq: int
) -> dict[str, Trainer]:
    """Build every configuration (first step timed), warm them up, then time ``rounds`` chunks of ``steps`` steps
    each, *interleaved* (A, B, C, A, B, C, ...) so that every configuration sees the same machine load."""
    trainers = {}
    for name, args in configs.items():
        trainers[name] = Trainer(batch, seq, **args)
        print(f"  {name}: first step {trainers[name].first_s:.2f} s", file=sys.stderr, flush=True)
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step()
    for _ in range(rounds):
        for trainer in trainers.values():
            trainer.timed(steps)
    return trainers


def machine() -> str:
    import torch

    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii") as fh:
            info = fh.read()
        model = re.search(r"model name\s*:\s*(.*)", info)
        have = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())  # type: ignore[union-attr]
        wanted = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
        flags = f"{model.group(1) if model else '?'}; " + ", ".join(
            f"{f}={'yes' if f in have else 'no'}" for f in wanted
        )
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores "
        f"({torch.get_num_threads()} torch threads), {flags}; load average at start {load:.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and configuration")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (the median round counts)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after the first one")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1 by default: on a shared machine more threads spin against each other)",
    )
    parser.add_argument("--write", type=Path, help="markdown file whose benchmark section to replace")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="accel-bench-inductor-"))

    lines = [
        SECTION,
        "",
        f"`python bench/precision.py` — {machine()}.",
        "",
        f"Model: embedding + 2 pre-norm `nn.TransformerEncoderLayer` (d=128, 4 heads, FFN 512) + LM head "
        f"(vocab 1000), 0.65 M parameters; batch {args.batch} x {args.seq} tokens, AdamW; one step = forward, "
        f"backward, optimizer step through `Kernel.prepare`. Steady rate: median of {args.rounds} rounds of "
        f"{args.steps} steps after {args.warmup} warm-up steps, the configurations of a table interleaved "
        "round by round so they share the machine's load.",
        "",
        "### Mixed precision (accel-plugin-amp)",
        "",
        "| mixed_precision | steps/s | vs fp32 | loss, first -> last step |",
        "|---|---|---|---|",
    ]
    shape = dict(steps=args.steps, warmup=args.warmup, rounds=args.rounds, batch=args.batch, seq=args.seq)
    precision = measure(
        {"no": {"mixed_precision": "no"}, "bf16": {"mixed_precision": "bf16"}, "fp16": {"mixed_precision": "fp16"}},
        **shape,
    )
    base = precision["no"].steps_per_s
    for mode, t in precision.items():
        label = "fp32 (`no`)" if mode == "no" else mode
        lines.append(
            f"| {label} | {t.steps_per_s:.1f} | {t.steps_per_s / base:.2f}x | {t.losses[0]:.4f} -> {t.losses[-1]:.4f} |"
        )
    del precision

    lines += [
        "",
        "### torch.compile (accel-plugin-dynamo)",
        "",
        "| dynamo_backend | first step (s) | steady steps/s | speed-up vs eager | steps to pay back the compile |",
        "|---|---|---|---|---|",
    ]
    from torch._dynamo.utils import counters

    compiled = measure(
        {
            "no (eager)": {},
            "aot_eager": {"dynamo_backend": "aot_eager"},
            "inductor": {"dynamo_backend": "inductor"},
            "inductor + bf16": {"dynamo_backend": "inductor", "mixed_precision": "bf16"},
        },
        **shape,
    )
    eager = compiled["no (eager)"]
    for name, t in compiled.items():
        if t is eager:
            lines.append(f"| no (eager) | {t.first_s:.2f} | {t.steps_per_s:.1f} | 1.00x | - |")
            continue
        per_eager, per_compiled = 1 / eager.steps_per_s, 1 / t.steps_per_s
        cost = t.first_s - eager.first_s
        payback = f"{cost / (per_eager - per_compiled):.0f}" if per_compiled < per_eager else "never"
        lines.append(
            f"| {name} | {t.first_s:.2f} | {t.steps_per_s:.1f} | {t.steps_per_s / eager.steps_per_s:.2f}x | {payback} |"
        )
    frames, models = int(counters["frames"]["ok"]), len(compiled) - 1
    recompiled = (
        "nothing was recompiled during the timed steps"
        if frames == models
        else f"{frames - models} recompilations happened after the first step"
    )
    lines += [
        "",
        f"Dynamo compiled {frames} frames for the {models} compiled models: {recompiled}. The first step "
        'of a compiled model includes compiling forward and backward (inductor: a cold cache); "steps to pay '
        'back" = extra first-step time / time saved per steady step. "inductor + bf16" is compared with '
        "fp32 eager.",
        "",
        "Reading the numbers: on a CPU without avx512_fp16/AMX, fp16 runs on slow fallback kernels, so fp16 is for "
        "GPUs (it is supported on CPU for correctness, not speed); bf16 needs avx512_bf16/AMX to gain. A model "
        "this small spends much of a step outside the compiled forward/backward (optimizer, Python), which "
        "limits what inductor can gain.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        old = args.write.read_text(encoding="utf-8") if args.write.exists() else "# Benchmarks\n\n"
        pattern = re.compile(re.escape(SECTION) + r".*?(?=^## |\Z)", re.S | re.M)
        new = pattern.sub(lambda _: text, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
