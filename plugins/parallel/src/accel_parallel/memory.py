"""``accel estimate-memory`` rows for the N-D mesh (no torch import).

For every tensor-parallel size ``tp`` that divides the process count (and for HSDP with two replicas), one row:
tensor parallel splits each ``Linear``/``Embedding`` weight ``tp`` ways (what a colwise or rowwise plan entry does;
Hugging Face plans cover exactly these), every other parameter is replicated across the tp group (norms, biases:
an over-estimate where a plan also splits colwise biases); FSDP2 then splits what a process holds on its first
dimension across ``dp_shard``. Weights, gradients and optimizer state stay fp32 (bf16 is FSDP2's mixed-precision
policy, as in the fsdp plugin); fp16 and fp8 are refused by the plugin. ``gathered`` is the largest layer's local
tensor-parallel piece unsharded, for parameters and gradients.

Pipeline rows (``pp=P, dp_shard=N/P``) are for the busiest stage of an even split by count of the model's
``layers.<i>`` (the first stage, which takes the extra layer), counting every parameter outside the layers
(embeddings, final norm, head) on that same stage: an upper bound (they are really split between the first and last
stages). Models without ``layers.<i>`` get no pipeline rows.
"""

from __future__ import annotations

import dataclasses
import math
import re

from accel.spi import MemoryQuery, MemoryRow, ModelSummary, unsupported

STRATEGY = "parallel"
SPLIT_BY_TP = ("Linear", "Embedding")


def local_numel(model: ModelSummary, tp: int, dp_shard: int, trainable_only: bool = False) -> int:
    """Elements one process holds with tensor parallel size ``tp`` and FSDP2 over ``dp_shard`` processes."""
    total = 0
    for p in model.parameters:
        if trainable_only and not p.trainable:
            continue
        shape = list(p.shape) or [1]
        if p.module_type in SPLIT_BY_TP and len(shape) == 2:
            shape[0] = math.ceil(shape[0] / tp)  # colwise splits dim 0, rowwise dim 1: the same count
        shape[0] = math.ceil(shape[0] / dp_shard)
        total += math.prod(shape)
    return total


def meshes(n: int) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, tp) shapes worth showing for ``n`` processes."""
    shapes = [(1, n // tp, tp) for tp in range(2, n + 1) if n % tp == 0]
    if n % 2 == 0 and n > 2:
        shapes.append((2, n // 2, 1))
    return shapes


LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def busiest_stage(model: ModelSummary, pp: int) -> ModelSummary | None:
    """The parameters of the busiest pipeline stage (see the module docstring), or None without ``layers.<i>``."""
    index = {p.name: int(m.group(1)) for p in model.parameters if (m := LAYER.search(p.name))}
    if not index:
        return None
    n_layers = max(index.values()) + 1
    if n_layers < pp:
        return None
    first = math.ceil(n_layers / pp)
    kept = tuple(p for p in model.parameters if index.get(p.name, 0) < first)
    return dataclasses.replace(model, parameters=kept)


def rows(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    n = query.num_processes
    out = []
    shapes: list[tuple[ModelSummary, str, int, int]] = [
        (model, f"dp_replicate={r}, dp_shard={s}, tp={tp}", s, tp) for r, s, tp in meshes(n)
    ]
    for pp in (p for p in range(2, n + 1) if n % p == 0):
        stage = busiest_stage(model, pp)
        if stage is not None:
            shapes.append((stage, f"pp={pp}, dp_shard={n // pp}, tp=1", n // pp, 1))
    for dtype in query.dtypes:
        for part, options, shard, tp in shapes:
            if dtype not in ("fp32", "bf16"):
                why = f"mixed_precision {dtype} is not supported with --plugin parallel (no or bf16)"
                out.append(unsupported(STRATEGY, options, dtype, n, why))
                continue
            trainable = local_numel(part, tp, shard, trainable_only=True)
            largest = math.ceil(model.largest_layer_numel / tp)
            out.append(
                MemoryRow(
                    STRATEGY,
                    options,
                    dtype,
                    n,
                    4 * local_numel(part, tp, shard),
                    4 * trainable,
                    4 * query.optimizer_states * trainable,
                    gathered=(4 if dtype == "fp32" else 2) * 2 * largest if shard > 1 else 0,
                )
            )
    return out
