"""Worker script of plugins/deepspeed/tests/test_deepspeed.py (``accel launch -n 2 --plugin deepspeed``): several
worker scripts one after another in one launch, so each process imports torch and DeepSpeed once for all of them.

``deepspeed_cases.py OUT NAME,...``: NAME is ``resume`` (deepspeed_resume.py) or ``matrix`` (deepspeed_matrix.py);
each runs in the one process group created here, with its own Kernels, models and optimizers, and writes its results
under OUT/NAME, then each process OUT/NAME/done<rank> when it has finished the script. A script that fails ends the processes (the other process may wait in one of its collectives): its
result and those of the scripts after it are missing, and the tests say which.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed_matrix
import deepspeed_resume
import torch.distributed as dist

RUNS = {"resume": deepspeed_resume.run, "matrix": deepspeed_matrix.run}

if __name__ == "__main__":
    os.environ.setdefault("ACCEL_DEEPSPEED_VERBOSE", "")
    dist.init_process_group("gloo")
    for name in sys.argv[2].split(","):
        RUNS[name](Path(sys.argv[1]) / name)
        (Path(sys.argv[1]) / name / f"done{dist.get_rank()}").touch()
    dist.destroy_process_group()
