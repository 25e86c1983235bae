"""Per-rank parameter + optimizer memory of FSDP (accel-plugin-fsdp) against DDP (accel-plugin-ddp) on 2 ranks, and
of a dp_shard=2 x tp=2 mesh (accel-plugin-parallel) against DDP on 4 ranks.

    python bench/memory.py            # print the table
    python bench/memory.py --write    # ... and update the fsdp-memory section of docs/benchmarks.md
    python bench/memory.py --mesh [--write]   # the 4-rank comparison (parallel-memory section)

Each strategy runs this file as a worker under ``accel launch -n 2 --plugin <strategy>``: an MLP of ``--layers``
blocks of two ``--hidden``-wide linear layers (the default is about 300 MiB of fp32 parameters), AdamW, one training
step. Each rank then counts the bytes of the tensors it holds: its parameters (FSDP: the local shards), their
gradients and the optimizer state; and reads its peak resident memory (VmHWM) from /proc/self/status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import block_class, machine, write_section  # noqa: E402

MB = 1024 * 1024


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from accel import Kernel

    Block = block_class()

    class Net(nn.Module):
        _no_split_modules = ["Block"]
        _tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}  # accel-plugin-parallel's tp dim

        def __init__(self, d: int, layers: int) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block(d) for _ in range(layers)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)

    kernel = Kernel(cpu=True)
    torch.manual_seed(0)
    meta = kernel.settings.get("fsdp_cpu_ram_efficient_loading") and not kernel.is_main_process
    with torch.device("meta" if meta else "cpu"):
        model = Net(args.hidden, args.layers)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = kernel.prepare(model, optimizer)
    x = torch.randn(4, args.hidden)
    loss = model(x).pow(2).mean()
    kernel.backward(loss)
    optimizer.step()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(tensors: list[torch.Tensor]) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors)

    params = list(kernel.unwrap_model(model).parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    row = {
        "rank": kernel.process_index,
        "model_bytes": total,
        "param_bytes": nbytes(params),
        "grad_bytes": nbytes([p.grad for p in params if p.grad is not None]),
        "optim_bytes": nbytes(state),
        "peak_rss_bytes": _peak_rss(),
    }
    rows = kernel.gather_object([row])
    if kernel.is_main_process:
        Path(args.worker).write_text(json.dumps(rows))
    kernel.end_training()


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


#: label -> accel launch arguments
STRATEGIES = {
    "ddp": ["--plugin", "ddp"],
    "fsdp": ["--plugin", "fsdp"],
    "fsdp, cpu_ram_efficient_loading": ["--plugin", "fsdp", "--fsdp_cpu_ram_efficient_loading"],
}


#: label -> accel launch arguments, 4 ranks (``--mesh``)
MESH_STRATEGIES = {
    "ddp": ["-n", "4", "--plugin", "ddp"],
    "parallel, dp_shard=2 x tp=2": [
        "-n",
        "4",
        "--plugin",
        "parallel",
        "--parallelism_config_dp_shard_size",
        "2",
        "--parallelism_config_tp_size",
        "2",
    ],
}


def run_strategy(launch_args: list[str], args: argparse.Namespace) -> list[dict[str, int]]:
    accel = str(Path(sys.executable).with_name("accel"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "ACCEL_HOME": tmp, "OMP_NUM_THREADS": "1"}
        n = [] if "-n" in launch_args else ["-n", "2"]
        cmd = [
            accel,
            "launch",
            "-q",
            *n,
            *launch_args,
            __file__,
            "--worker",
            str(out),
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
        ]
        subprocess.run(cmd, check=True, env=env)
        return json.loads(out.read_text())


def table(results: dict[str, list[dict[str, int]]]) -> str:
    model_mb = results["ddp"][0]["model_bytes"] / MB
    lines = [
        f"Model: {model_mb:.0f} MiB of fp32 parameters, AdamW, 2 CPU ranks (gloo), after one step. "
        "Bytes of the tensors each rank holds; peak RSS from /proc/self/status (VmHWM).",
        "",
        "| strategy | rank | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | params + optimizer (MiB) "
        "| peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for strategy, rows in results.items():
        for r in rows:
            lines.append(
                f"| {strategy} | {r['rank']} | {r['param_bytes'] / MB:.1f} | {r['grad_bytes'] / MB:.1f} | "
                f"{r['optim_bytes'] / MB:.1f} | {(r['param_bytes'] + r['optim_bytes']) / MB:.1f} | "
                f"{r['peak_rss_bytes'] / MB:.0f} |"
            )

    def worst(s: str, field: str) -> int:
        return (
            max(r[field] for r in results[s])
            if field != "p+o"
            else max(r["param_bytes"] + r["optim_bytes"] for r in results[s])
        )

    ratio = worst("fsdp", "p+o") / worst("ddp", "p+o")
    rss = worst("fsdp", "peak_rss_bytes") / worst("ddp", "peak_rss_bytes")
    rss_meta = worst("fsdp, cpu_ram_efficient_loading", "peak_rss_bytes") / worst("ddp", "peak_rss_bytes")
    lines += [
        "",
        f"FSDP / DDP, parameters + optimizer state per rank (largest rank): **{ratio:.3f}x** "
        f"(target <= 0.55x). Peak RSS per rank (largest rank), which also counts the interpreter, torch and "
        f"the full model each rank builds before sharding: {rss:.2f}x; with fsdp_cpu_ram_efficient_loading "
        f"(only rank 0 builds real weights, the others use the meta device): {rss_meta:.2f}x.",
    ]
    return "\n".join(lines)


def mesh_table(results: dict[str, list[dict[str, int]]]) -> str:
    model_mb = results["ddp"][0]["model_bytes"] / MB
    lines = [
        f"Model: {model_mb:.0f} MiB of fp32 parameters (blocks of two linear layers, tensor-parallel plan fc1 "
        "colwise, fc2 rowwise), AdamW, 4 CPU ranks (gloo), after one step. Bytes of the tensors each rank "
        "holds (local shards of DTensors).",
        "",
        "| strategy | rank | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | params + optimizer (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for strategy, rows in results.items():
        for r in rows:
            lines.append(
                f"| {strategy} | {r['rank']} | {r['param_bytes'] / MB:.2f} | {r['grad_bytes'] / MB:.2f} | "
                f"{r['optim_bytes'] / MB:.2f} | {(r['param_bytes'] + r['optim_bytes']) / MB:.2f} |"
            )
    worst = {s: max(r["param_bytes"] + r["optim_bytes"] for r in rows) for s, rows in results.items()}
    label = next(s for s in results if s != "ddp")
    lines += [
        "",
        f"dp_shard=2 x tp=2 / DDP, parameters + optimizer state per rank (largest rank): "
        f"**{worst[label] / worst['ddp']:.3f}x** (target <= 0.3x; the ideal is 0.25x, the rest is the "
        "row-parallel biases, which tensor parallel keeps whole on each tp rank).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=9, help="blocks of two hidden x hidden linear layers")
    parser.add_argument("--write", action="store_true", help="update the fsdp-memory section of docs/benchmarks.md")
    parser.add_argument("--mesh", action="store_true", help="dp_shard=2 x tp=2 (accel-plugin-parallel) vs DDP, 4 ranks")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter finalization: it sometimes aborts under load after the work is done
    where = machine()
    if args.mesh:
        body = mesh_table({label: run_strategy(a, args) for label, a in MESH_STRATEGIES.items()})
        print(body)
        if args.write:
            write_section(
                "parallel-memory",
                "## N-D parallel (dp_shard x tp) vs DDP: memory per process\n\n"
                f"`python bench/memory.py --mesh --hidden 1024 --layers 8 --write`; "
                f"{where}\n\n{body}\n",
            )
        return
    results = {label: run_strategy(launch_args, args) for label, launch_args in STRATEGIES.items()}
    body = table(results)
    print(body)
    if args.write:
        write_section(
            "fsdp-memory",
            f"## FSDP vs DDP: memory per process\n\n`python bench/memory.py --write`; {where}\n\n{body}\n",
        )


if __name__ == "__main__":
    main()
