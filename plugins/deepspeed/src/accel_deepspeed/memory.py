"""``accel estimate-memory`` rows for DeepSpeed ZeRO (no torch or deepspeed import).

DeepSpeed's own accounting (``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_...``), per process, with
P trainable and F frozen parameter elements, N processes, h bytes per training-dtype element (2 for bf16/fp16,
4 for fp32) and k fp32 optimizer states per element (Adam 2, SGD with momentum 1, SGD 0):

- the weights are held in the training dtype: h(P+F), or h(P+F)/N partitioned by stage 3;
- gradients in the training dtype: hP/N partitioned (stages 1-3: DeepSpeed 0.19 reduce-scatters them during
  backward in stage 1 too, measured), hP for stage 0, plus the fp32 gradient partition of the master weights, 4P/N
  (4P for stage 0); in fp32, stages 1-2 reduce straight into the fp32 partition (no second copy, measured);
- the optimizer keeps fp32 master weights (4 bytes, a copy even in fp32 from stage 1) and its states: (4 + 4k)P/N
  (stage 0: (4 + 4k)P; in fp32, stage 0 steps the weights themselves: 4P + 4P + 4kP like DDP);
- stage 3 allocates its gradient reduce bucket whole: ``reduce_bucket_size`` elements (DeepSpeed's default 5e8,
  used unless a JSON config sets another) in the training dtype, counted with the gradients; and it gathers the
  largest layer's weights and gradients at once: 2hL (``gathered``);
- ``offload_optimizer_device cpu`` moves the master weights, fp32 gradients and states to host memory (the reduced
  gradients are copied straight there: no 16-bit gradient partition stays on the device),
  ``offload_param_device cpu`` (stage 3) the partitioned weights too.

With bf16/Adam, stage 2 is DeepSpeed's 2P + 18P/N. For stage 3 DeepSpeed's estimator says 4L + 18P/N; measured on
2 CPU processes, the 16-bit gradient partition (2P/N) is still alive at the optimizer step and the reduce bucket
exists too, so the row says 4L + 20P/N + the bucket.
"""

from __future__ import annotations

from accel.spi import ELEMENT_BYTES, MemoryQuery, MemoryRow, ModelSummary, unsupported

STRATEGY = "DeepSpeed"
#: DeepSpeed's default ``reduce_bucket_size`` (elements): ZeRO-3 allocates this bucket whole, in the training dtype.
REDUCE_BUCKET_SIZE = 500_000_000
#: (stage, offload optimizer, offload params)
OPTION_SETS = (
    (0, False, False),
    (1, False, False),
    (2, False, False),
    (2, True, False),
    (3, False, False),
    (3, True, False),
    (3, True, True),
)


def _label(stage: int, offload_optimizer: bool, offload_params: bool) -> str:
    label = f"ZeRO-{stage}"
    if offload_optimizer:
        label += " + offload optimizer" + (", params" if offload_params else "")
    return label


def row(
    model: ModelSummary, query: MemoryQuery, dtype: str, stage: int, offload_optimizer: bool, offload_params: bool
) -> MemoryRow:
    n = query.num_processes
    label = _label(stage, offload_optimizer, offload_params)
    if dtype == "fp8":
        return unsupported(STRATEGY, label, dtype, n, "mixed_precision fp8 is not supported by the DeepSpeed plugin")
    h = ELEMENT_BYTES[dtype]
    p, total = model.trainable_numel, model.numel
    if stage == 0 and dtype == "fp32":  # the engine steps the torch optimizer on the weights themselves
        return MemoryRow(STRATEGY, label, dtype, n, 4 * total, 4 * p, 4 * query.optimizer_states * p)
    parts = n if stage >= 1 else 1
    params = h * total // (n if stage == 3 else 1)
    # in fp32, stages 1-2 reduce straight into the fp32 gradient partition; stage 3 keeps its own partition too
    half_grads = h * p // parts if h < 4 or stage == 3 else 0
    fp32_grads = 4 * p // parts
    bucket = h * REDUCE_BUCKET_SIZE if stage == 3 else 0
    optim = (4 + 4 * query.optimizer_states) * p // parts
    gathered = 2 * h * model.largest_layer_numel if stage == 3 else 0
    cpu = 0
    if offload_optimizer:  # the reduced gradients go straight into the fp32 partition in host memory
        cpu += fp32_grads + optim
        half_grads = fp32_grads = optim = 0
    if offload_params:
        cpu += params
        params = 0
    note = "optimizer includes the fp32 master weights"
    if bucket:
        note += f"; gradients include the {REDUCE_BUCKET_SIZE:.0e}-element reduce bucket (reduce_bucket_size)"
    return MemoryRow(
        STRATEGY,
        label,
        dtype,
        n,
        params,
        half_grads + fp32_grads + bucket,
        optim,
        cpu=cpu,
        gathered=gathered,
        note=note,
    )


def rows(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    return [row(model, query, dtype, *options) for dtype in query.dtypes for options in OPTION_SETS]
