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


def data(device: torch.device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch ``(inputs, targets)``; another ``seed`` gives another batch of the same shapes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SAMPLES, FEATURES, generator=g).to(device), torch.randn(SAMPLES, 2, generator=g).to(device)


def compiled_graphs() -> int:
    """How many graphs TorchDynamo has captured and handed to a ``torch.compile`` backend in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


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
    return state_difference(a, b) is None


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Where two tensors differ: shape or dtype, else how many elements and the first differing one."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} of shape {tuple(a.shape)} against {b.dtype} of shape {tuple(b.shape)}"
    a, b = a.detach().cpu(), b.detach().cpu()
    unequal = a != b
    if a.is_floating_point() or a.is_complex():
        unequal &= ~(torch.isnan(a) & torch.isnan(b))
    count = int(unequal.sum())
    if not count:
        return None
    first = tuple(int(i) for i in unequal.nonzero()[0])
    at = first if len(first) != 1 else first[0]
    return f"{count} of {a.numel()} elements differ, the first at index {at}: {a[first].item()!r} against {b[first].item()!r}"


def state_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The first place where two state dicts differ, in words (``None``: they hold the same values, tensors equal,
    floats equal up to rounding): its key path, and for a tensor how many elements differ and the first of them
    (``a``'s value, then ``b``'s)."""
    here = where or "the value"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{here}: a {type(a).__name__} against a {type(b).__name__}"
        found = _tensor_difference(a, b)
        return f"{here}: {found}" if found else None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{here}: keys {sorted(map(str, a))} against {sorted(map(str, b))}"
        for key in a:
            found = state_difference(a[key], b[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{here}: {len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = state_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, (int, float)):
        same = math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    else:
        same = bool(a == b)
    return None if same else f"{here}: {a!r:.80} against {b!r:.80}"
