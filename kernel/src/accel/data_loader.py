"""``accelerate.data_loader`` under its accel path: what accel has of it, the same objects as elsewhere in accel
(``skip_first_batches``, ``DataLoaderConfiguration``); ``prepare_data_loader`` is ``kernel.prepare_data_loader``.
The guide's table (accel-accelerate: ``python -m accel_accelerate.names``) maps each of its names."""

from __future__ import annotations

from accel.data import skip_first_batches
from accel.data_arguments import DataLoaderConfiguration

__all__ = ["DataLoaderConfiguration", "skip_first_batches"]
