"""Generic helpers for a user's own multi-process tests, as Accelerate's ``accelerate.test_utils`` has them (its
scripts import them from there): a linear-regression dataset and model whose
gradients are easy to compare between processes, and :func:`assert_exception`.

``RegressionDataset``/``RegressionModel`` are Accelerate's (same arguments, same numbers for a seed)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class RegressionDataset:
    """``length`` points ``{"x": x, "y": a * x + b + noise}`` (float32 numpy scalars) drawn from
    ``numpy.random.default_rng(seed)``: Accelerate 1.15's numbers for a seed; numpy's global generator is left alone."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """``x * a + b`` with two scalar parameters (Accelerate's, without the dtypes it prints on the first batch)."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        assert x is not None
        return x * self.a + self.b


@contextlib.contextmanager
def assert_exception(exception_class: type[BaseException], msg: str | None = None) -> Iterator[None]:
    """The block must raise ``exception_class`` (with ``msg`` in its message when given); an AssertionError
    otherwise. Accelerate's ``accelerate.test_utils.testing.assert_exception``."""
    try:
        yield
    except Exception as error:
        assert isinstance(error, exception_class), f"Expected {exception_class.__name__}, got {type(error).__name__}"
        if msg is not None:
            assert msg in str(error), f"Expected {msg!r} in the exception's message, got {str(error)!r}"
    else:
        raise AssertionError(f"Expected {exception_class.__name__}, but the block ran without one")
