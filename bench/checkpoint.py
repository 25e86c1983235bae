"""Benchmark: ``save_state`` + ``load_state`` of a ~500 MB model against raw safetensors on the same disk.

    python bench/checkpoint.py [--size-mb 512] [--repeats 11] [--dir DIR] [--write]

The raw baseline is what the same tensors cost by hand: ``safetensors.torch.save_file(model.state_dict())`` then
``load_file`` + ``model.load_state_dict`` (loading means the weights end up in the model; ``load_file`` alone maps
the file lazily). It is measured twice: as is, and with an ``os.fsync`` of the file after writing, because
``save_state`` fsyncs every file and directory before it publishes a checkpoint (that is what makes a crash leave a
complete checkpoint). ``ratio`` = raw time / save_state+load_state time (1.0 = no overhead; higher is better).
Each round runs every variant once (alternating the order); the ratio is the median over rounds of the per-round
ratio, so rounds disturbed by other work on a shared machine cancel out. The page cache stays warm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from accel import Kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, write_section  # noqa: E402


def build(size_mb: int) -> nn.Module:
    width = 2048
    per_layer = (width * width + width) * 4
    layers = max(1, round(size_mb * 2**20 / per_layer))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_round(model: nn.Module, path: Path, fsync: bool) -> tuple[float, float]:
    from safetensors.torch import load_file, save_file

    def save() -> None:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.fspath(path))
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def load() -> None:
        model.load_state_dict(load_file(os.fspath(path)))

    t_save, t_load = timed(save), timed(load)
    path.unlink()
    return t_save, t_load


def accel_round(kernel: Kernel, target: Path) -> tuple[float, float]:
    t_save = timed(lambda: kernel.save_state(target))
    t_load = timed(lambda: kernel.load_state(target))
    shutil.rmtree(target)
    return t_save, t_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--write", action="store_true", help="update the checkpoint section of docs/benchmarks.md")
    args = parser.parse_args()

    base = Path(args.dir or tempfile.mkdtemp(prefix="accel-bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    kernel = Kernel(cpu=True)
    model = build(args.size_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state: the checkpoint is the model
    model, optimizer = kernel.prepare(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())

    results: dict[str, list[tuple[float, float]]] = {"raw": [], "raw+fsync": [], "accel": []}
    rounds = {
        "raw": lambda: raw_round(model, base / "raw.safetensors", fsync=False),
        "raw+fsync": lambda: raw_round(model, base / "raw.safetensors", fsync=True),
        "accel": lambda: accel_round(kernel, base / "ckpt"),
    }
    try:
        for i in range(args.repeats):
            order = list(rounds) if i % 2 == 0 else list(reversed(rounds))  # no variant always goes first
            for name in order:
                results[name].append(rounds[name]())
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    def total(name: str, i: int) -> float:
        return results[name][i][0] + results[name][i][1]

    rows = [
        "| variant | save (s), median | load (s), median | save + load (s), median | save + load (s), best "
        "| ratio raw / accel (median of per-round ratios) |",
        "|---|---|---|---|---|---|",
    ]
    labels = (("raw", "raw safetensors (`save_file`; `load_file` + `load_state_dict`)"),
              ("raw+fsync", "raw safetensors + `os.fsync` of the file"),
              ("accel", "`save_state` + `load_state`"))
    for name, label in labels:
        saves = [r[0] for r in results[name]]
        loads = [r[1] for r in results[name]]
        totals = [total(name, i) for i in range(args.repeats)]
        ratios = [total(name, i) / total("accel", i) for i in range(args.repeats)]
        ratio = "" if name == "accel" else f"{statistics.median(ratios):.2f}x"
        rows.append(f"| {label} | {statistics.median(saves):.2f} | {statistics.median(loads):.2f} "
                    f"| {statistics.median(totals):.2f} | {min(totals):.2f} | {ratio} |")
    disk = shutil.disk_usage(base if base.exists() else base.parent)
    info = (f"Model: {len(model)} x Linear(2048, 2048), {nbytes / 2**20:.0f} MiB of fp32 tensors, SGD without state. "
            f"{args.repeats} rounds, each running every variant once; files on the disk of {base} "
            f"({disk.total / 2**30:.0f} GiB); warm page cache; load average at the end {os.getloadavg()[0]:.1f}.")
    table = "\n".join(rows)
    print(info)
    print(table)
    if args.write:
        write_section("checkpoint", "## Checkpoints: `save_state` + `load_state` vs raw safetensors\n\n"
                                    f"`python bench/checkpoint.py --write`; {machine()}\n\n{info}\n\n{table}\n")
    kernel.end_training()
    sys.exit(0)


if __name__ == "__main__":
    main()
