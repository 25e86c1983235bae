"""``accelerate.test_utils.testing``: ``assert_exception`` (accel's :mod:`accel.testing.regression`) and the
``require_*`` decorators and ``torch_device`` Accelerate's test scripts use."""

from __future__ import annotations

import unittest
from typing import Any

import torch

from accel.testing.regression import assert_exception


def _backend() -> str:
    for kind in ("cuda", "mps", "xpu", "npu", "hpu"):
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return kind
    return "cpu"


#: The device type Accelerate's tests run on (its ``get_backend()``'s first answer).
torch_device = _backend()


def require_bnb(test_case: Any) -> Any:
    """Skip ``test_case`` where bitsandbytes is not installed."""
    from accelerate.utils import is_bnb_available

    return unittest.skipUnless(is_bnb_available(), "test requires the bitsandbytes library")(test_case)


__all__ = ["assert_exception", "require_bnb", "torch_device"]
