"""``accelerate.data_loader``: ``skip_first_batches`` and the configuration of prepared dataloaders."""

from __future__ import annotations

from accel.data_arguments import DataLoaderConfiguration
from accel.data import skip_first_batches

__all__ = ["DataLoaderConfiguration", "skip_first_batches"]
