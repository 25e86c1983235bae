"""``accelerate.test_utils``: the helpers Accelerate's own multi-process test scripts import (``RegressionDataset``,
``RegressionModel``, ``are_the_same_tensors``, ``require_bnb``, ``torch_device``), accel's :mod:`accel.testing.regression`."""

from __future__ import annotations

import torch

from accel.testing.regression import RegressionDataset, RegressionModel
from accelerate.test_utils.testing import require_bnb, torch_device


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the same on every process."""
    from accelerate.state import PartialState

    state = PartialState()
    tensor = tensor[None].clone().to(state.device)
    gathered = state._view._kernel.gather(tensor).cpu()
    return all(torch.equal(gathered[i], tensor[0].cpu()) for i in range(gathered.shape[0]))


__all__ = ["RegressionDataset", "RegressionModel", "are_the_same_tensors", "require_bnb", "torch_device"]
