"""The model of tests/test_estimate_memory.py: `accel estimate-memory estimate_model:net` estimates it and
estimate_measure.py trains it (8.4 M parameters, 33.6 MB in fp32: big enough that the bytes held per process are
far above allocator noise)."""

from __future__ import annotations

from torch import nn


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024))
