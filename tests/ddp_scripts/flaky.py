"""Worker for the ``--max_restarts`` tests of tests/test_ddp_behaviour.py.

    accel launch --max_restarts 1 -n 2 flaky.py OUT_DIR once     # rank 1 fails on the first attempt only
    accel launch --max_restarts 1 -n 2 flaky.py OUT_DIR always   # rank 1 fails on every attempt

Every attempt appends a line to ``OUT_DIR/attempts_rank<r>.txt``; a successful run writes ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from accel import Kernel


def main() -> None:
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    kernel = Kernel()
    rank = kernel.process_index
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    with (out_dir / f"attempts_rank{rank}.txt").open("a") as f:
        f.write(f"restart {restart}\n")
    kernel.wait_for_everyone()
    marker = out_dir / "failed_once"
    if rank == 1 and (mode == "always" or not marker.exists()):
        marker.write_text("rank 1 failed here\n")
        sys.exit(1)
    total = kernel.reduce(torch.tensor([rank + 1]), "sum")
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": kernel.num_processes,
                                                          "restart": restart, "sum": total.tolist()}))
    kernel.end_training()


if __name__ == "__main__":
    main()
