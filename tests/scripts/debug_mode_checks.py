"""Worker for tests/test_debug_mode.py: collectives with and without debug mode on N real processes.

    accel launch -n 2 [--debug] tests/scripts/debug_mode_checks.py OUT_DIR [kernel-argument]

``kernel-argument``: the script asks for debug mode itself, ``Kernel(debug=True)``.

Each case runs on every process; a case that raises records the error's class and message and the next case goes
on (in debug mode a mismatch is found before the real collective, so the processes stay in step). Each process
writes OUT_DIR/rank{process_index}.json.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accel import Kernel

OUT = Path(sys.argv[1])
kernel = Kernel(debug=True) if sys.argv[2:] == ["kernel-argument"] else Kernel()
rank = kernel.process_index


def mismatched_gather() -> Any:  # the rows differ in width: process 0 has 3 columns, process 1 has 5
    return kernel.gather(torch.ones(2, 3 + 2 * rank))


def different_operations() -> Any:  # process 0 gathers, process 1 reduces
    return kernel.gather(torch.ones(2)) if rank == 0 else kernel.reduce(torch.ones(2))


def mismatched_reduce_dtype() -> Any:
    return kernel.reduce(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64))


def mismatched_broadcast() -> Any:
    return kernel.broadcast(torch.zeros(2 + rank))


def pad_against_gather() -> Any:  # process 0 pads, process 1 gathers
    return kernel.pad_across_processes(torch.zeros(2)) if rank == 0 else kernel.gather(torch.zeros(2))


def gather_object_against_barrier() -> Any:
    return kernel.gather_object([rank]) if rank == 0 else kernel.wait_for_everyone()


def matched() -> Any:  # what works without debug works with it: rows of different lengths, objects, padding
    return {
        "gather": kernel.gather(torch.full((1 + rank, 2), float(rank))).tolist(),
        "reduce": kernel.reduce(torch.ones(2), "sum").tolist(),
        "broadcast": kernel.broadcast(torch.full((2,), float(rank))).tolist(),
        "pad": kernel.pad_across_processes(torch.ones(1 + rank)).tolist(),
        "gather_object": kernel.gather_object([rank]),
    }


MISMATCHED: list[Callable[[], Any]] = [
    mismatched_gather,
    different_operations,
    mismatched_reduce_dtype,
    mismatched_broadcast,
    pad_against_gather,
    gather_object_against_barrier,
]
results: dict[str, Any] = {
    "debug": kernel.settings["debug"],
    "collectives": type(kernel.collectives).__name__,
    "matched": matched(),
}
if kernel.settings["debug"]:  # without debug these hang or fail inside the backend: not run
    for case in MISMATCHED:
        try:
            case()
            results[case.__name__] = None
        except Exception as exc:
            results[case.__name__] = [type(exc).__name__, str(exc)]
    results["matched_after"] = matched()
(OUT / f"rank{rank}.json").write_text(json.dumps(results))
kernel.end_training()
