"""Turning a user's model into an FSDP2 model: the plugin API's toolkit (:mod:`accel.spi.sharded`) does it; its
names stay importable from here."""

from accel.spi.sharded import ShardConfig, wrap_units

__all__ = ["ShardConfig", "wrap_units"]
