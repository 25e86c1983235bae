"""The script ``accel test`` launches on every process: a short real run through the Kernel with the current config.

Checks, on every process: the world (process indices 0..N-1, WORLD_SIZE), collectives (gather, reduce, broadcast,
gather_object), a few steps of training with gradient accumulation (loss goes down, parameters stay identical on
every process), ``gather_for_metrics`` over an evaluation set that does not divide evenly, and autocast when mixed
precision is on. Every process's results are gathered on the main process, which writes them as JSON to
``--report`` and prints them. Exit code 0 when every check passed on every process, else 1.

    python -m accel.commands.selfcheck                       # one process
    accel launch -n 2 $(python -c 'import accel.commands.selfcheck as m; print(m.__file__)')
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Checks:
    """Runs named checks; a failing check is recorded with its reason and the others still run."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], str]) -> None:
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as exc:  # a check that fails must not hide the others
            detail, ok = " ".join(f"{type(exc).__name__}: {exc}".split()), False
            traceback.print_exc()
        self.results.append(
            {"name": name, "ok": ok, "detail": detail, "seconds": round(time.perf_counter() - start, 3)}
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=None, help="directory to write report.json into (main process)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Kernel
    from accel.options import int_env

    kernel = Kernel()
    n, rank = kernel.num_processes, kernel.process_index
    checks = Checks()

    def world() -> str:
        expected = int_env(os.environ, "WORLD_SIZE", 1)
        assert n == expected, f"Kernel sees {n} processes, WORLD_SIZE says {expected}"
        indices = kernel.gather_object([rank])
        assert indices == list(range(n)), f"process indices {indices}, expected 0..{n - 1}"
        return f"{n} process(es), this is {rank}, device {kernel.device}"

    def collectives() -> str:
        got = kernel.gather(torch.tensor([rank], device=kernel.device))
        assert got.tolist() == list(range(n)), f"gather gave {got.tolist()}"
        total = kernel.reduce(torch.tensor(float(rank + 1), device=kernel.device), "sum")
        assert total.item() == n * (n + 1) / 2, f"reduce(sum) gave {total.item()}"
        value = kernel.broadcast(torch.tensor([float(rank) + 7.0], device=kernel.device), from_process=0)
        assert value.item() == 7.0, f"broadcast from 0 gave {value.item()}"
        rows = kernel.gather(torch.ones(rank + 1, 2, device=kernel.device))  # uneven rows per process
        assert rows.shape[0] == n * (n + 1) // 2, f"uneven gather gave {tuple(rows.shape)}"
        return "gather, reduce, broadcast, uneven gather"

    def training() -> str:
        torch.manual_seed(0)
        x = torch.randn(256, 8)
        y = x @ torch.arange(1.0, 9.0)[:, None] + 0.5
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
        model, optimizer, loader, sched = kernel.prepare(model, optimizer, loader, sched)

        def mean_loss() -> float:
            with torch.no_grad():
                out = model(x.to(kernel.device))
                return float(torch.nn.functional.mse_loss(out.float(), y.to(kernel.device)))

        before = mean_loss()
        for _ in range(max(1, args.steps // max(1, len(loader)) + 1)):
            for xb, yb in loader:
                with kernel.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
                    kernel.backward(loss)
                    optimizer.step()
                    sched.step()
                    optimizer.zero_grad()
        after = mean_loss()
        assert after < before, f"loss did not go down: {before:.4f} -> {after:.4f}"
        # The same input must give the same output on every process (replicas in sync, or shards gathered alike).
        losses = kernel.gather(torch.tensor([after], device=kernel.device)).cpu()
        spread = (losses.max() - losses.min()).item()
        assert abs(spread) < 1e-5, (
            f"the model gives different losses on different processes (spread {spread:g}): gradients not synchronised"
        )
        # The full parameters, through the kernel's state-dict API (gathered from shards where a plugin shards them):
        # every process that receives them (all, or only the main one) must hold the same values, of full shape.
        state = kernel.get_state_dict(model)
        full = {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in state.items()}
        everyone = [s for s in kernel.gather_object([full]) if s]
        assert everyone, "get_state_dict gave the parameters on no process"
        reference = everyone[0]
        shapes = {k: len(v) for k, v in reference.items()}
        assert shapes == {"weight": 8, "bias": 1}, f"get_state_dict gave {shapes} elements, expected weight 8, bias 1"
        for other in everyone[1:]:
            diff = max(abs(a - b) for k in reference for a, b in zip(reference[k], other[k], strict=True))
            assert diff < 1e-5, f"parameters differ between processes by {diff:g} (gradients not synchronised)"
        return (
            f"loss {before:.3f} -> {after:.3f}, same output on all processes, full parameters from "
            f"get_state_dict on {len(everyone)} of {n} process(es) agree"
        )

    def metrics() -> str:
        items = torch.arange(13, dtype=torch.float32)
        loader = kernel.prepare(DataLoader(TensorDataset(items), batch_size=2))
        seen = [kernel.gather_for_metrics(batch) for (batch,) in loader]
        seen_all = torch.cat(seen).cpu()
        assert len(seen_all) == 13, f"gather_for_metrics returned {len(seen_all)} items over an epoch, expected 13"
        assert sorted(seen_all.tolist()) == items.tolist(), "gather_for_metrics lost or duplicated items"
        return "13 items over an epoch, none lost or duplicated"

    def precision() -> str:
        if kernel.mixed_precision == "no":
            return "mixed precision off"
        layer = torch.nn.Linear(4, 4).to(kernel.device)
        with kernel.autocast():
            out = layer(torch.randn(2, 4, device=kernel.device))
        return f"{kernel.mixed_precision}: forward under autocast gives {out.dtype}"

    for name, fn in (
        ("world", world),
        ("collectives", collectives),
        ("training", training),
        ("gather_for_metrics", metrics),
        ("mixed precision", precision),
    ):
        checks.run(name, fn)
    try:
        everyone = kernel.gather_object([{"process": rank, "results": checks.results}])
    except Exception as exc:  # the collectives are broken: report this process alone
        print(f"[process {rank}] cannot gather results: {type(exc).__name__}: {exc}", file=sys.stderr)
        everyone = [{"process": rank, "results": checks.results}]
    ok = all(r["ok"] for p in everyone for r in p["results"])
    if kernel.is_main_process:
        summary = {
            "ok": ok,
            "num_processes": n,
            "device": str(kernel.device),
            "mixed_precision": kernel.mixed_precision,
            "plugins": [f"{c.name}:{c.role}" for c in kernel.components],
            "processes": everyone,
        }
        for proc in everyone:
            for r in proc["results"]:
                mark = "ok  " if r["ok"] else "FAIL"
                print(f"accel test [process {proc['process']}] {mark} {r['name']}: {r['detail']}")
        if args.report:
            Path(args.report).mkdir(parents=True, exist_ok=True)
            (Path(args.report) / "report.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    kernel.end_training()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
