"""The hook plugin shout adds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.spi import KernelView, hookspec

if TYPE_CHECKING:
    import torch


@hookspec
def accel_shout_words(kernel: KernelView, model: torch.nn.Module) -> list[str]:
    """Words to shout when ``model`` is prepared. Who: every active component that implements it; the answers are
    shouted in the order the kernel asks components."""
