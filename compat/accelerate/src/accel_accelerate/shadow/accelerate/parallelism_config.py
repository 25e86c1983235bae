"""``accelerate.parallelism_config``: ``ParallelismConfig``, the sizes of the device mesh. accel-plugin-parallel
reads its fields (``Accelerator(parallelism_config=...)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ParallelismConfig:
    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    sp_size: int | None = None
    cp_backend: str | None = None
    sp_backend: str | None = None
    cp_handler: Any = None
    sp_handler: Any = None
    tp_handler: Any = None

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, 1)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig({name}=...) must be a whole number >= 1, got {value!r}")
        self.cp_backend = self.cp_backend or "torch"
        self.sp_backend = self.sp_backend or "deepspeed"

    @property
    def total_size(self) -> int:
        return int(self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size)  # type: ignore[operator]

    @property
    def dp_enabled(self) -> bool:
        return bool(self.dp_replicate_size > 1 or self.dp_shard_size > 1)  # type: ignore[operator]

    @property
    def dp_replicate_enabled(self) -> bool:
        return bool(self.dp_replicate_size > 1)  # type: ignore[operator]

    @property
    def dp_shard_enabled(self) -> bool:
        return bool(self.dp_shard_size > 1)  # type: ignore[operator]

    @property
    def tp_enabled(self) -> bool:
        return bool(self.tp_size > 1)  # type: ignore[operator]

    @property
    def cp_enabled(self) -> bool:
        return bool(self.cp_size > 1)  # type: ignore[operator]

    @property
    def sp_enabled(self) -> bool:
        return bool(self.sp_size > 1)  # type: ignore[operator]

    @property
    def active_mesh_dims(self) -> list[str]:
        sizes = (
            ("dp_replicate", self.dp_replicate_size),
            ("dp_shard", self.dp_shard_size),
            ("cp", self.cp_size),
            ("sp", self.sp_size),
            ("tp", self.tp_size),
        )
        return [name for name, size in sizes if size > 1]  # type: ignore[operator]


__all__ = ["ParallelismConfig"]
