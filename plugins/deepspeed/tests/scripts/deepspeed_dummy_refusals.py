"""Worker of plugins/deepspeed/tests/test_deepspeed_dummy.py, a plain `python` process (DeepSpeed on a world of one): the mistakes
around DummyOptim/DummyScheduler and a config file's optimizer/scheduler sections, each one clear line from
prepare(). Prints one JSON object: case -> "ExceptionName: message"."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel
from accel_deepspeed import DummyOptim, DummyScheduler

WITH_SECTIONS, WITHOUT = sys.argv[1], sys.argv[2]


def attempt(kernel: Kernel, make: object) -> str:
    model = nn.Linear(4, 1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    try:
        kernel.prepare(model, *make(model), loader)  # type: ignore[operator]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def main() -> None:
    out = {}
    sections = Kernel(plugins=["deepspeed"], deepspeed_config_file=WITH_SECTIONS)
    out["torch_optimizer_with_section"] = attempt(sections, lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)])
    out["torch_scheduler_with_section"] = attempt(
        sections, lambda m: [o := DummyOptim(m.parameters()), torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0)]
    )
    plain = Kernel(plugins=["deepspeed"], deepspeed_config_file=WITHOUT)
    out["dummy_optimizer_without_section"] = attempt(plain, lambda m: [DummyOptim(m.parameters())])
    out["dummy_scheduler_without_section"] = attempt(
        plain, lambda m: [o := torch.optim.SGD(m.parameters(), lr=0.1), DummyScheduler(o)]
    )
    try:
        DummyOptim(nn.Linear(2, 2).parameters()).step()
    except Exception as exc:
        out["dummy_step"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    plain.end_training()
    sections.end_training()


if __name__ == "__main__":
    main()
