"""Records and arithmetic of ``accel estimate-memory``: what a model holds per process while it trains.

No torch here (strategy plugins answer ``accel_estimate_memory`` at module level, where torch must not be
imported). The command measures the model on the meta device and hands a :class:`ModelSummary` to every plugin;
each strategy returns :class:`MemoryRow` records for its own options.

The precision rule (the meaning of each ``--dtypes`` value is accel's ``mixed_precision`` setting):

- ``fp32``: fp32 weights, fp32 gradients, fp32 optimizer state.
- ``bf16``/``fp16``/``fp8`` under autocast (or a sharding strategy's mixed-precision policy): the weights stay
  fp32 and *are* the master weights; gradients and optimizer state stay fp32. Lower-precision copies of the weights
  exist only while a forward runs (autocast's cast cache, a gathered shard unit), so they count towards
  activations, not towards the model states reported here.
- ``bf16``/``fp16`` in a strategy that trains half-precision weights: 2-byte weights and gradients plus fp32
  master weights (4 bytes), kept with the optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: The ``--dtypes`` values, accel's ``mixed_precision`` names for them, and the bytes of one element.
DTYPES = ("fp32", "bf16", "fp16", "fp8")
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
#: Bytes of one element of each ``--dtypes`` value.
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

#: Optimizer choices and the fp32 state elements each keeps per trainable parameter element.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass(frozen=True)
class ParameterInfo:
    """One parameter tensor of the model (each shared tensor once)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    module_type: str  # class name of the module that owns it ("Linear", "Embedding", ...)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSummary:
    """What the model holds, measured on the meta device: its parameters (each shared tensor once) and its largest
    layer, DeepSpeed's measure of it: the module with the most parameters of its own (roughly what a sharding
    strategy gathers at once)."""

    name: str
    parameters: tuple[ParameterInfo, ...]
    largest_layer: str
    largest_layer_numel: int
    buffer_bytes: int = 0

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parameters)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.parameters if p.trainable)

    def sharded_numel(self, parts: int, trainable_only: bool = False) -> int:
        """Elements one process holds when every parameter is split on its first dimension into ``parts`` equal,
        padded pieces (FSDP2's ``Shard(0)``)."""
        total = 0
        for p in self.parameters:
            if trainable_only and not p.trainable:
                continue
            if not p.shape:
                total += 1
                continue
            total += math.ceil(p.shape[0] / parts) * math.prod(p.shape[1:])
        return total


@dataclass(frozen=True)
class MemoryQuery:
    """What the user asked: the number of processes, the precisions (``DTYPES``) and the optimizer
    (``OPTIMIZER_STATES``)."""

    num_processes: int
    dtypes: tuple[str, ...]
    optimizer: str = "adamw"

    @property
    def optimizer_states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]


@dataclass(frozen=True)
class MemoryRow:
    """Bytes one process holds for the model states, without activations, for one strategy and option set.

    ``parameters``, ``gradients`` and ``optimizer`` are on the training device (gradients include communication
    buckets a strategy keeps; optimizer includes fp32 master weights kept apart from the parameters);
    ``cpu`` is what an offloading option moves to host memory instead (0 without offload); ``gathered`` is the
    extra that a sharding strategy materialises at once for the largest layer during forward/backward.
    ``supported`` is false for combinations the plugin refuses (``note`` says why)."""

    strategy: str
    options: str
    dtype: str
    processes: int
    parameters: int
    gradients: int
    optimizer: int
    cpu: int = 0
    gathered: int = 0
    note: str = ""
    supported: bool = True

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class Replicated:
    """The model states of autocast training with every state replicated (single process, DDP, XLA)."""

    parameters: int
    gradients: int
    optimizer: int


def replicated(model: ModelSummary, query: MemoryQuery) -> Replicated:
    """fp32 weights, fp32 gradients of the trainable ones, fp32 optimizer state (whatever the autocast dtype)."""
    trainable = model.trainable_numel
    return Replicated(4 * model.numel, 4 * trainable, 4 * query.optimizer_states * trainable)


def unsupported(strategy: str, options: str, dtype: str, processes: int, why: str) -> MemoryRow:
    """The row of a combination the plugin refuses in a run, with the reason (shown as "not supported")."""
    return MemoryRow(strategy, options, dtype, processes, 0, 0, 0, note=why, supported=False)


def single_process_rows(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    """The kernel's own row: one process, no strategy plugin."""
    rows = []
    for dtype in query.dtypes:
        states = replicated(model, query)
        rows.append(MemoryRow("single process", "-", dtype, 1, states.parameters, states.gradients, states.optimizer))
    return rows


def format_bytes(value: float) -> str:
    """``1.50 GiB``, ``12.00 MiB``, ``512 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)} B"


def sorted_rows(rows: Iterable[MemoryRow], dtypes: Sequence[str]) -> list[MemoryRow]:
    """Rows grouped by dtype (in the order asked), then as the plugins gave them."""
    order = {d: i for i, d in enumerate(dtypes)}
    return sorted(rows, key=lambda r: order.get(r.dtype, len(order)))


__all__ = [
    "DTYPES",
    "ELEMENT_BYTES",
    "MIXED_PRECISION",
    "OPTIMIZER_STATES",
    "MemoryQuery",
    "MemoryRow",
    "ModelSummary",
    "ParameterInfo",
    "Replicated",
    "format_bytes",
    "replicated",
    "single_process_rows",
    "sorted_rows",
    "unsupported",
]
