"""accel-plugin-xla: the entry-point module. Cheap to import: no torch or torch_xla here (see ``strategy.py``).

Activates when selected (``accel launch --plugin xla``, ``Kernel(plugins=["xla"])``, Accelerate's
``distributed_type: XLA``) or when ``PJRT_DEVICE`` names an XLA runtime. Its options are Accelerate's TPU keys.
"""

from __future__ import annotations

import glob
import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from accel.spi import HardwareInfo, Options, Question, Settings, UsageError, hookimpl
from accel_xla.availability import unavailable_reason

if TYPE_CHECKING:
    from accel.spi import MemoryQuery, MemoryRow, ModelSummary

NAME = "xla"
accel_components = ["accel_xla.strategy:XLAStrategy"]

#: PJRT runtimes torch_xla knows (``GPU`` is the old name of ``CUDA``).
PJRT_DEVICES = ("TPU", "CPU", "CUDA", "GPU")


@hookimpl
def accel_add_options(options: Options) -> None:
    add = options.add
    add(
        "tpu_use_cluster",
        type="bool",
        default=False,
        flags=("--tpu_cluster", "--tpu-cluster"),
        help="Start the run on every worker of a TPU pod through gcloud (needs tpu_name and tpu_zone).",
    )
    add("tpu_name", help="Name of the TPU (pod) to run on, as gcloud knows it.")
    add("tpu_zone", help="Zone of the TPU, e.g. us-central2-b.")
    add("tpu_use_sudo", type="bool", default=False, help="Run the training command on the pod's workers with sudo.")
    add(
        "tpu_env",
        type="list",
        default=[],
        flags=("--env",),
        help="Environment variables NAME=VALUE set for the training command on the pod's workers (repeatable).",
    )
    add(
        "tpu_vm",
        type="list",
        default=[],
        flags=("--vm",),
        help="Accelerate's legacy TPU-node VM names; not supported (TPU VM pods are reached with --worker all).",
    )
    add(
        "commands",
        type="list",
        default=[],
        flags=("--command",),
        help="Shell commands run on every pod worker before the training command (repeatable).",
    )
    add("command_file", help="File of shell commands (one per line) run on every pod worker before training.")
    add(
        "tpu_use_alpha",
        type="bool",
        default=False,
        flags=("--use_alpha",),
        help="Use `gcloud alpha compute tpus tpu-vm ssh` instead of `gcloud compute ...`.",
    )
    add(
        "downcast_bf16",
        type="bool",
        default=False,
        env=("ACCEL_DOWNCAST_BF16", "ACCELERATE_DOWNCAST_BF16"),
        help="With mixed_precision bf16 on XLA: store the model's parameters in bf16 too (not only compute).",
    )


def _count(pattern: str) -> int:
    return len(glob.glob(pattern))


def device_count(runtime: str, env: Mapping[str, str]) -> int:
    """Devices of a PJRT runtime on this machine, from the environment and /dev, without torch_xla."""
    if runtime == "TPU":
        return _count("/dev/accel[0-9]*") or _count("/dev/vfio/[0-9]*") or 1
    if runtime == "CPU":
        return max(1, int(env.get("CPU_NUM_DEVICES") or 1))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return int(env.get("GPU_NUM_DEVICES") or 0) or _count("/proc/driver/nvidia/gpus/*") or 1


@hookimpl
def accel_detect_hardware(env: Mapping[str, str]) -> HardwareInfo | None:
    runtime = (env.get("PJRT_DEVICE") or "").strip().upper()
    if runtime not in PJRT_DEVICES or importlib.util.find_spec("torch_xla") is None:
        return None
    runtime = "CUDA" if runtime == "GPU" else runtime
    return HardwareInfo(
        name="xla", device_count=device_count(runtime, env), priority=20, details={"PJRT_DEVICE": runtime}
    )


@hookimpl
def accel_unavailable_reason() -> str | None:
    return unavailable_reason()


def wanted(settings: Settings) -> bool:
    """Whether this run asks for XLA: selected by name or distributed_type, or PJRT_DEVICE names a runtime (a strategy
    the user selected by name still wins the strategy role then)."""
    if settings.is_selected(NAME):
        return True
    return (settings.env.get("PJRT_DEVICE") or "").strip().upper() in PJRT_DEVICES


@hookimpl
def accel_activate(settings: Settings) -> object | None:
    if not wanted(settings):
        return None
    reason = unavailable_reason()
    pod = settings.phase == "launch" and settings["tpu_use_cluster"]
    if reason is not None and not pod:  # a pod launch only runs gcloud here; the workers need torch_xla
        if not settings.is_selected(NAME):
            return None  # PJRT_DEVICE alone does not make a run fail; `accel plugins` shows why xla is off
        raise UsageError(reason)
    from accel_xla.strategy import XLAStrategy

    return XLAStrategy(settings)


@hookimpl
def accel_config_questions(answers: Mapping[str, Any]) -> Sequence[Question] | None:
    if answers.get("distributed_type") != "XLA":
        return None
    questions = [
        Question(
            "main_training_function",
            "What is the name of the function in your script that should be launched in all parallel processes?",
            kind="text",
            default="main",
        ),
        Question("tpu_use_cluster", "Are you using a TPU pod (several workers)?", kind="confirm", default=False),
    ]
    if answers.get("tpu_use_cluster"):
        questions += [
            Question("tpu_name", "What is the name of your TPU pod?", kind="text"),
            Question("tpu_zone", "In which zone is it (e.g. us-central2-b)?", kind="text"),
            Question(
                "tpu_use_sudo",
                "Should the training command run with sudo on the workers?",
                kind="confirm",
                default=False,
            ),
        ]
    if answers.get("mixed_precision") == "bf16":
        questions.append(
            Question(
                "downcast_bf16",
                "Should the model's parameters be stored in bf16 too (not only computed in bf16)?",
                kind="confirm",
                default=False,
            )
        )
    return questions


@hookimpl
def accel_estimate_memory(model: ModelSummary, query: MemoryQuery) -> list[MemoryRow]:
    """Every process holds the whole model, as with DDP (gradients are all-reduced in place): fp32 weights,
    gradients and optimizer state; ``downcast_bf16`` stores the weights and gradients in bf16 instead."""
    from accel.spi import MemoryRow, replicated

    out = []
    for dtype in query.dtypes:
        s = replicated(model, query)
        out.append(MemoryRow("XLA", "-", dtype, query.num_processes, s.parameters, s.gradients, s.optimizer))
        if dtype == "bf16":
            out.append(
                MemoryRow(
                    "XLA",
                    "downcast_bf16",
                    dtype,
                    query.num_processes,
                    s.parameters // 2,
                    s.gradients // 2,
                    s.optimizer // 2,
                )
            )
    return out
