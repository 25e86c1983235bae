"""``accel estimate-memory`` rows for DistributedDataParallel (no torch import).

Every process holds the whole model: fp32 weights, fp32 gradients and fp32 optimizer state (autocast leaves them
fp32 for bf16/fp16/fp8). The gradients are views into DDP's gradient buckets (``ddp_gradient_as_bucket_view``, on
by default); turned off, the reducer keeps the buckets as one more fp32 copy of the trainable gradients.
"""

from __future__ import annotations

from accel.spi import MemoryQuery, MemoryRow, ModelSummary, replicated


def rows(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    out = []
    for dtype in query.dtypes:
        states = replicated(model, query)
        buckets = 4 * model.trainable_numel
        out.append(
            MemoryRow(
                "DDP",
                "default",
                dtype,
                query.num_processes,
                states.parameters,
                states.gradients,
                states.optimizer,
            )
        )
        out.append(
            MemoryRow(
                "DDP",
                "gradient_as_bucket_view off",
                dtype,
                query.num_processes,
                states.parameters,
                states.gradients + buckets,
                states.optimizer,
            )
        )
    return out
