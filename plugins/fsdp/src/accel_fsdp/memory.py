"""``accel estimate-memory`` rows for FSDP2 (``fully_shard``; no torch import).

Each parameter is split on its first dimension into ``num_processes`` padded shards (``Shard(0)``): a process keeps
its fp32 shard, the fp32 gradient shard and the fp32 optimizer state of it. bf16 (MixedPrecisionPolicy) only changes
the dtype of the gathered copies used in forward/backward (``gathered``: the largest layer's parameters and
gradients unsharded); ``fsdp_offload_params`` keeps all three in host memory.
"""

from __future__ import annotations

from accel.spi import MemoryQuery, MemoryRow, ModelSummary, unsupported

STRATEGY = "FSDP"


def rows(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    n = query.num_processes
    out = []
    for dtype in query.dtypes:
        if dtype not in ("fp32", "bf16"):
            out.append(
                unsupported(
                    STRATEGY, "-", dtype, n, f"mixed_precision {dtype} is not supported with --plugin fsdp (no or bf16)"
                )
            )
            continue
        params = 4 * model.sharded_numel(n)
        trainable = model.sharded_numel(n, trainable_only=True)
        grads, optim = 4 * trainable, 4 * query.optimizer_states * trainable
        gathered = (4 if dtype == "fp32" else 2) * 2 * model.largest_layer_numel
        out.append(MemoryRow(STRATEGY, "FULL_SHARD", dtype, n, params, grads, optim, gathered=gathered))
        out.append(
            MemoryRow(
                STRATEGY,
                "SHARD_GRAD_OP",
                dtype,
                n,
                params,
                grads,
                optim,
                gathered=gathered + (4 if dtype == "fp32" else 2) * model.numel,
                note="gathered also holds every layer's weights from forward to backward",
            )
        )
        out.append(
            MemoryRow(
                STRATEGY,
                "FULL_SHARD + offload_params",
                dtype,
                n,
                0,
                0,
                0,
                cpu=params + grads + optim,
                gathered=gathered,
            )
        )
        for name in ("HYBRID_SHARD", "NO_SHARD"):
            out.append(
                unsupported(
                    STRATEGY,
                    name,
                    dtype,
                    n,
                    f"{name} is not supported by FSDP2 here (FULL_SHARD or SHARD_GRAD_OP; DDP for no sharding)",
                )
            )
    return out
