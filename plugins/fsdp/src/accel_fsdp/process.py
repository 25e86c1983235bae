"""Processes for the FSDP strategy: torchrun arguments, the torch.distributed environment, collectives.

The torch.distributed helpers are the kernel's (``accel.distributed``, shared with every process-group strategy);
torch is imported inside functions so the CLI can plan a launch without it.
"""

from __future__ import annotations

import os

from accel import LaunchPlan
from accel.distributed import launch_with_torchrun, torchrun_env


def launch(plan: LaunchPlan) -> int:
    """Run the workers through torchrun in this process and wait; return the exit code."""
    return launch_with_torchrun(plan, "fsdp")


def distributed_env() -> None:
    """Make sure the torch.distributed variables exist: from torchrun, translated from SLURM, or a world of one
    (the plugin was selected for a plain ``python train.py``)."""
    torchrun_env(os.environ)
