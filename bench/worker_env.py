"""Prints, from rank 0 of a launched job, what its workers run under: environment, torch threads, CPU affinity,
niceness (bench/run.py compares `accel launch --plugin ddp` with `torchrun`)."""

import json
import os

import torch

if os.environ.get("RANK", "0") == "0":
    seen = {f"env {k}": v for k, v in os.environ.items()}
    seen.update(
        {
            "torch threads": torch.get_num_threads(),
            "torch interop threads": torch.get_num_interop_threads(),
            "CPU affinity": sorted(os.sched_getaffinity(0)),
            "nice": os.nice(0),
        }
    )
    print(json.dumps(seen))
