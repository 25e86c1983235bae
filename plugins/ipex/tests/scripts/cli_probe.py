"""Launched by the CLI tests: prepares a tiny model and reports what the worker saw. Optional first argument
``--touch PATH`` writes PATH (to prove a dry run starts nothing); ``--exit N`` exits with N."""

import sys
from pathlib import Path

import torch

from accel import Kernel

args = sys.argv[1:]
if args[:1] == ["--touch"]:
    Path(args[1]).write_text("started\n")
kernel = Kernel()
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = kernel.prepare(model, optimizer)
print(
    f"PROBE rank={kernel.process_index} world={kernel.num_processes} "
    f"hello_imported={'accel_hello' in sys.modules} components={sorted(c.name for c in kernel.components)} "
    f"args={args}",
    flush=True,
)
kernel.end_training()
if args[:1] == ["--exit"]:
    sys.exit(int(args[1]))
