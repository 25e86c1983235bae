"""Worker for tests/test_distributed.py's launcher tests (restarts, exit codes): it does not import torch, so a
process costs ~0.05 s of CPU instead of ~3 s; what those tests check is the launcher's bookkeeping, not the worker's.

    accel launch -n 2 restart_probe.py OUT_DIR [--fail_once MARKER] [--exit_code N]

Every attempt appends ``restart {TORCHELASTIC_RESTART_COUNT}`` to OUT_DIR/attempts_rank{RANK}.txt and waits for
every process of the attempt to have done so (a file barrier, where a real worker has the rendezvous). With
``--exit_code N`` every process exits with N. With ``--fail_once MARKER`` process 0 fails (exit 1) if MARKER does not
exist (and writes it); the processes finish, writing OUT_DIR/rank{RANK}.json, only once process 0 has got past that
point in this attempt: like a collective, a failed process 0 leaves the others waiting until the launcher stops them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--fail_once", type=Path, default=None)
parser.add_argument("--exit_code", type=int, default=None)
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")


def wait_for(path: Path, why: str) -> None:
    """Poll for ``path`` (bounded): a process the launcher stops while it waits never gets past this."""
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"process {rank}: {why} did not happen in 120 s")
        time.sleep(0.05)


args.out.mkdir(parents=True, exist_ok=True)
with (args.out / f"attempts_rank{rank}.txt").open("a") as fh:
    fh.write(f"restart {restart}\n")
# Every process of this attempt has started before any goes on (as the process group's rendezvous would make it):
# a process that failed at once would otherwise let the launcher stop the others before they wrote their line.
(args.out / f"started_attempt{restart}_rank{rank}").write_text("")
for other in range(world):
    wait_for(args.out / f"started_attempt{restart}_rank{other}", f"the start of process {other}")
if args.exit_code is not None:
    print(f"process {rank} exits with {args.exit_code} on purpose", file=sys.stderr)
    sys.exit(args.exit_code)
passed = args.out / f"rank0_passed_attempt{restart}"
if args.fail_once is not None and rank == 0:
    if not args.fail_once.exists():
        args.fail_once.write_text("failed once")
        print("process 0 fails on purpose (first attempt)", file=sys.stderr)
        sys.exit(1)
    passed.write_text("")
if args.fail_once is not None:
    wait_for(passed, "process 0 getting past --fail_once")  # stopped here by the launcher when process 0 failed
env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
(args.out / f"rank{rank}.json").write_text(json.dumps({"env": env}))
