"""accel-accelerate: the ``accelerate`` import name backed by accel and its plugins, so transformers' ``Trainer``,
TRL, PEFT and diffusers' training scripts run on accel unchanged. ``python -m accel_accelerate`` says whether this
process imports accel's ``accelerate`` and why (the switch is :mod:`accel_accelerate.startup`)."""

from __future__ import annotations

#: The Accelerate release whose API the façade implements (``accelerate.__version__`` and its metadata).
ACCELERATE_API_VERSION = "1.15.0"
