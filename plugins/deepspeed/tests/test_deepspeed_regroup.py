"""Under DeepSpeed, a launched process that ends its ``Kernel`` (``end_training`` destroys the process group) and
starts a new one gets a working group again, as the ddp plugin's does (plugins/ddp/tests/test_ddp_regroup.py;
tests/compat/test_examples.py runs DeepSpeed's ZeRO-2, ZeRO-3 and config-file ports in one launch that way).
Before: ``deepspeed.init_distributed`` made the new group with the keys of the destroyed one in torchrun's agent
store, and a process read the other's old address and hung connecting; and the next engine used DeepSpeed's
cached clone of the destroyed world group ("Group ... is not registered")."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from dstools import EXTENSIONS

from accel.testing import run_launch

SCRIPT = textwrap.dedent(
    """
    import json, os, time
    import torch
    from accel import Kernel

    sums = []
    for k in range(3):
        if k and int(os.environ["RANK"]) == 1:
            time.sleep(1)  # rank 0 reaches the new group first and must not read rank 1's address of the old one
        kernel = Kernel(cpu=True)
        model = torch.nn.Linear(4, 2)
        loader = torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=4)
        model, optimizer, loader = kernel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
        kernel.backward(model(next(iter(loader))).sum())  # an engine of the new group
        optimizer.step()
        sums.append(kernel.reduce(torch.tensor([kernel.process_index + 10.0 * k]), "sum").item())
        kernel.end_training()
    os.write(1, f"SUMS {json.dumps(sums)}\\n".encode())  # one write: the two processes share the pipe
    """
)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # the first DeepSpeed run of a clean workspace builds its CPU op
def test_a_new_kernel_after_end_training_gets_a_working_process_group(tmp_path: Path) -> None:
    script = tmp_path / "regroup.py"
    script.write_text(SCRIPT)
    proc = run_launch(
        ["--plugin", "deepspeed", "--zero_stage", "2", str(script)],
        registered=["deepspeed"],
        home=tmp_path / "home",
        env={"TORCH_EXTENSIONS_DIR": EXTENSIONS},
        cwd=tmp_path,
        timeout=850,
    )
    sums = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("SUMS ")]
    assert sums == [[1.0, 21.0, 41.0]] * 2, proc.stdout + proc.stderr
