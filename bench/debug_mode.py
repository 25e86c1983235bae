"""Debug mode's cost: a collective with debug off, as before debug mode existed, and with debug on.

    accel launch -n 2 bench/debug_mode.py [--calls 50] [--rounds 61]

Each process times ``kernel.reduce`` and ``kernel.gather`` (1,024 floats) three ways, interleaved round by round in
the same processes: **before** (the Kernel's collectives set to what ``accel_collectives`` answers, the line the
Kernel ran before debug mode), **off** (the Kernel built with ``debug`` off, as it is now) and **on** (the same Kernel
with its collectives wrapped as ``debug: true`` wraps them). Process 0 prints the medians (µs per call) and the
medians of the per-round ratios (each round times the three ways back to back, so a loaded machine slows all three
alike) as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from accel import Kernel
from accel.debug import CheckedCollectives


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=61)
    args = parser.parse_args()
    kernel = Kernel()
    assert kernel.num_processes > 1 and not kernel.settings["debug"], "run it under accel launch -n 2, without --debug"
    ways = {
        "before": kernel.plugins.pm.hook.accel_collectives(kernel=kernel),
        "off": kernel.collectives,
        "on": CheckedCollectives(kernel.collectives, kernel.process_index),
    }
    tensor = torch.randn(1024)
    ops: dict[str, Callable[[], Any]] = {
        "reduce": lambda: kernel.reduce(tensor),
        "gather": lambda: kernel.gather(tensor),
    }
    times: dict[str, dict[str, list[float]]] = {op: {way: [] for way in ways} for op in ops}
    for op, fn in ops.items():
        for collectives in ways.values():  # warm-up
            kernel.collectives = collectives
            per_call_us(fn, 50)
        for _ in range(args.rounds):
            for way, collectives in ways.items():
                kernel.collectives = collectives
                kernel.wait_for_everyone()
                times[op][way].append(per_call_us(fn, args.calls))
    kernel.collectives = ways["off"]
    if kernel.is_main_process:
        result: dict[str, Any] = {"processes": kernel.num_processes, "calls": args.calls, "rounds": args.rounds}
        for op, by_way in times.items():
            med = {way: statistics.median(ts) for way, ts in by_way.items()}
            paired = {
                "off_over_before": [o / b for o, b in zip(by_way["off"], by_way["before"], strict=True)],
                "on_over_off": [o / b for o, b in zip(by_way["on"], by_way["off"], strict=True)],
            }
            result[op] = {
                **{f"{way}_us": round(m, 1) for way, m in med.items()},
                **{name: round(statistics.median(r), 3) for name, r in paired.items()},
                "off_over_before_quartiles": [round(q, 3) for q in statistics.quantiles(paired["off_over_before"])],
            }
        print(json.dumps(result, indent=1))
    kernel.end_training()


if __name__ == "__main__":
    main()
