"""A launched process that trains, ends (``end_training`` destroys the process group) and starts a new ``Kernel``
gets a working group again, as often as it does so (tests/test_resume_real_loaders.py runs several variants in one
launch that way). torchrun's agent store keeps the keys of the destroyed group, and torch names the new group as it
named the old one: without keys of its own, a process read the other's old address and hung connecting."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from accel.testing import run_launch

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from accel import Kernel

    sums = []
    for k in range(3):
        if k and int(os.environ["RANK"]) == 1:
            time.sleep(1)  # rank 0 reaches the new group first and must not read rank 1's address of the old one
        kernel = Kernel(cpu=True)
        sums.append(kernel.reduce(torch.tensor([kernel.process_index + 10.0 * k]), "sum").item())
        kernel.end_training()
    os.write(1, f"SUMS {json.dumps(sums)}\\n".encode())  # one write: the two processes share the pipe
    """
)


@pytest.mark.multiprocess
def test_a_new_kernel_after_end_training_gets_a_working_process_group(tmp_path: Path) -> None:
    script = tmp_path / "regroup.py"
    script.write_text(SCRIPT)
    proc = run_launch([str(script)], registered=["ddp"], home=tmp_path / "home", cwd=tmp_path, timeout=120)
    sums = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("SUMS ")]
    assert sums == [[1.0, 21.0, 41.0]] * 2, proc.stdout + proc.stderr
