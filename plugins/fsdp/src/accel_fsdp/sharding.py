"""Turning a user's model into an FSDP2 model: the plugin API's toolkit (:mod:`accel.spi.sharded`) does it; its
names stay importable from here."""

from accel.spi.sharded import ParamSwap, ShardConfig, shard_model, wrap_units

__all__ = ["ParamSwap", "ShardConfig", "shard_model", "wrap_units"]
