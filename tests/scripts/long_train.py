"""Launched by the signal tests: trains a tiny model for a long time (DDP on gloo when launched on several
processes), after writing ``PIDDIR/rank<N>.pid`` once the Kernel is ready. Arguments: PIDDIR [seconds]."""

import os
import sys
import time
from pathlib import Path

import torch

from accel import Kernel

piddir = Path(sys.argv[1])
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 600.0
kernel = Kernel()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(64, 8))
loader = torch.utils.data.DataLoader(data, batch_size=4)  # DeepSpeed takes its micro-batch size from it
model, optimizer, loader = kernel.prepare(model, optimizer, loader)
piddir.mkdir(parents=True, exist_ok=True)
(piddir / f"rank{kernel.process_index}.pid").write_text(str(os.getpid()))
end = time.monotonic() + seconds
while time.monotonic() < end:
    for (batch,) in loader:
        loss = model(batch).pow(2).mean()
        kernel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.05)
kernel.end_training()
