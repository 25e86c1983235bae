"""Models, data and comparisons for the precision and compiler conformance suites (:mod:`accel.testing.conformance`),
which train in the test's own process. Imports torch."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

SAMPLES = 16
FEATURES = 4
LR = 0.1


class Net(torch.nn.Module):
    """Two linear layers with a ReLU between them (its forward is this module's code, not ``torch.nn``'s, so
    ``torch.compile`` compiles it whatever way a compiler calls it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(FEATURES, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


class Probe(Net):
    """:class:`Net` that records, in each forward, whether autocast is on and the dtype the first layer computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden(x)
        self.seen.append((torch.is_autocast_enabled(x.device.type), hidden.dtype))
        return self.out(torch.relu(hidden))


def data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, FEATURES, generator=g).to(device), torch.randn(SAMPLES, 2, generator=g).to(device)


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def prepared(kernel: Any, module: torch.nn.Module) -> tuple[Any, Any, torch.nn.Module]:
    """``(prepared model, prepared optimizer, an untouched copy of the module for reference)``."""
    reference = copy.deepcopy(module).to(kernel.device)
    model, optimizer = kernel.prepare(module, torch.optim.SGD(module.parameters(), lr=LR))
    return model, optimizer, reference


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().float()
    diff = float((got.detach().float() - want).norm())
    return diff / max(float(want.norm()), 1e-12)


def autocast_state(device_type: str) -> tuple[bool, torch.dtype, int]:
    """Whether autocast is on for ``device_type``, its dtype, and the autocast nesting level."""
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), level - 1


def restore_autocast(device_type: str, state: tuple[bool, torch.dtype, int]) -> None:
    """Put autocast back as :func:`autocast_state` found it (after a plugin that left it on)."""
    enabled, dtype, level = state
    torch.set_autocast_enabled(device_type, enabled)
    torch.set_autocast_dtype(device_type, dtype)
    while autocast_state(device_type)[2] > level:
        torch.autocast_decrement_nesting()
    torch.clear_autocast_cache()


def same_state(a: Any, b: Any) -> bool:
    """Whether two state dicts hold the same values (tensors equal, floats equal up to rounding)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)
