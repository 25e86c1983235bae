"""``accel_deepspeed`` under Accelerate."""

from accelerate.utils import DummyOptim, DummyScheduler  # noqa: F401
