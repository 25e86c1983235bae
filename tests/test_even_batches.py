"""even_batches=False never hangs (docs/design.md, "The Kernel loop"): on 2 real processes (ddp, gloo), for
map-style and iterable datasets, loaded in the process or by worker processes, the process that runs out of data
gets empty batches until every process has finished the epoch; DDP's all-reduce and gather_for_metrics stay in
step, and gather_for_metrics returns every sample exactly once per epoch. A hang fails on the timeout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import launch_env

SCRIPT = Path(__file__).parent / "scripts" / "uneven_batches.py"
ACCEL = Path(sys.executable).parent / "accel"
SIZE, EPOCHS = 50, 2  # 13 batches of 4: 7 for one process, 6 for the other

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("kind,workers", [("map", 0), ("map", 2), ("iterable", 0), ("iterable", 2)])
def test_uneven_batches_finish_in_step(tmp_path: Path, kind: str, workers: int) -> None:
    cmd = [
        str(ACCEL),
        "launch",
        "-q",
        "-n",
        "2",
        str(SCRIPT),
        "--kind",
        kind,
        "--workers",
        str(workers),
        "--size",
        str(SIZE),
        "--epochs",
        str(EPOCHS),
        "--out",
        "u",
    ]
    try:
        proc = subprocess.run(cmd, env=launch_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"even_batches=False hung ({kind}, {workers} workers)") from exc
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"u.rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert sum(ranks[0]["rows"]) + sum(ranks[1]["rows"]) == SIZE * EPOCHS  # nothing duplicated, nothing lost
    assert 0 in ranks[1]["rows"], "the process that ran out got no empty batch"
    for r in ranks:
        assert sorted(r["gathered"]) == sorted(list(range(SIZE)) * EPOCHS)
