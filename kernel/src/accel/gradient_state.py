"""The state a Kernel shares with its prepared dataloaders: whether this step syncs gradients, and where the epoch
is (Accelerate's ``GradientState``, one per Kernel). The Kernel makes it; :mod:`accel.data`'s dataloaders tell it
when they start, end and hand out their last batch."""

from __future__ import annotations

from typing import Protocol


class Loader(Protocol):
    """What the state reads of a prepared dataloader (:class:`accel.data.PreparedDataLoader` is one)."""

    end_of_dataloader: bool

    @property
    def remainder(self) -> int: ...


class GradientState:
    """Shared between the Kernel and its dataloaders: whether this step syncs and where the epoch is."""

    def __init__(self) -> None:
        self.sync_gradients = True
        self.step = 0
        self.active: list[Loader] = []
        #: Whether the innermost dataloader being iterated has handed out its last batch. A plain attribute, kept
        #: up to date by ``enter``/``leave``/``refresh`` (the dataloaders call them), since every step reads it.
        self.end_of_dataloader = False

    def enter(self, loader: Loader) -> None:
        self.active.append(loader)
        self.refresh()

    def leave(self, loader: Loader) -> None:
        if loader in self.active:
            self.active.remove(loader)
        self.refresh()

    def refresh(self) -> None:
        """Read ``end_of_dataloader`` again from the innermost active dataloader (after it changed)."""
        self.end_of_dataloader = bool(self.active) and self.active[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        return self.active[-1].remainder if self.active else 0

    @property
    def active_dataloader(self) -> Loader | None:
        """The prepared dataloader being iterated (the innermost one when loops nest), or None (Accelerate's)."""
        return self.active[-1] if self.active else None

    @staticmethod
    def _reset_state() -> None:
        """Accelerate resets its process-wide GradientState with it (its tests call it between Accelerators);
        accel's is one per Kernel, so there is nothing to reset."""

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared dataloader is being iterated (Accelerate's)."""
        return bool(self.active)
