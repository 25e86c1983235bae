"""accel-plugin-amp: the entry-point module. Cheap to import: no torch here (see ``precision.py``).

Takes part when ``mixed_precision`` is ``fp16``, ``bf16`` or ``fp8`` (from ``Kernel(mixed_precision=...)``,
``accel launch --mixed_precision``, the environment or the config file).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from accel.spi import Component, Options, Question, Settings, UsageError, hookimpl

NAME = "amp"
accel_components = ["accel_amp.precision:AmpPrecision", "accel_amp.precision:ScaledAmpPrecision"]  # bf16/fp8, fp16

#: torchao float8 training recipes (``Float8LinearConfig.from_recipe_name``).
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@hookimpl
def accel_add_options(options: Options) -> None:
    add = options.add
    # torch.amp.GradScaler arguments (Accelerate's GradScalerKwargs), used with fp16.
    add(
        "grad_scaler_init_scale",
        handler="GradScalerKwargs.init_scale",
        type="float",
        default=65536.0,
        minimum=0,
        cli=False,
        help="fp16: initial loss scale of the gradient scaler.",
    )
    add(
        "grad_scaler_growth_factor",
        handler="GradScalerKwargs.growth_factor",
        type="float",
        default=2.0,
        minimum=1,
        cli=False,
        help="fp16: factor the loss scale grows by after growth_interval steps without overflow.",
    )
    add(
        "grad_scaler_backoff_factor",
        handler="GradScalerKwargs.backoff_factor",
        type="float",
        default=0.5,
        minimum=0,
        maximum=1,
        cli=False,
        help="fp16: factor the loss scale shrinks by when a step overflows (and is skipped).",
    )
    add(
        "grad_scaler_growth_interval",
        handler="GradScalerKwargs.growth_interval",
        type="int",
        default=2000,
        minimum=1,
        cli=False,
        help="fp16: steps without overflow before the loss scale grows.",
    )
    add(
        "grad_scaler_enabled",
        type="bool",
        default=True,
        cli=False,
        handler="GradScalerKwargs.enabled",
        help="fp16: use the gradient scaler (false: unscaled fp16 gradients).",
    )
    # torch.autocast arguments (Accelerate's AutocastKwargs).
    add(
        "autocast_enabled",
        type="bool",
        default=True,
        cli=False,
        handler="AutocastKwargs.enabled",
        help="Run the forward of prepared models under autocast (false: in the parameters' own precision).",
    )
    add(
        "autocast_cache_enabled",
        type="bool",
        cli=False,
        handler="AutocastKwargs.cache_enabled",
        help="torch.autocast(cache_enabled=...); unset: torch's default.",
    )
    # fp8 through torchao (Accelerate's fp8_config keys for the AO backend).
    add(
        "fp8_backend",
        default="AO",
        choices=("AO", "TE", "MSAMP"),
        config_key="fp8_config.backend",
        help="fp8 implementation; accel-plugin-amp provides AO (torchao float8 training).",
    )
    add(
        "fp8_recipe",
        default="tensorwise",
        choices=FP8_RECIPES,
        config_key="fp8_config.recipe",
        help="torchao float8 scaling recipe.",
    )
    add(
        "fp8_pad_inner_dim",
        type="bool",
        default=False,
        config_key="fp8_config.pad_inner_dim",
        help="Pad the inner dimension of fp8 matmuls to a multiple of 16 (converts Linear layers of any size).",
    )
    add(
        "fp8_enable_fsdp_float8_all_gather",
        type="bool",
        default=False,
        config_key="fp8_config.enable_fsdp_float8_all_gather",
        help="All-gather FSDP2 weights in fp8 (tensorwise recipe only).",
    )
    add(
        "fp8_emulate",
        type="bool",
        default=False,
        config_key="fp8_config.emulate",
        help="Emulate fp8 matmuls (any device, slow): test an fp8 recipe without a GPU of compute capability 8.9+.",
    )


@hookimpl
def accel_config_questions(answers: Mapping[str, Any]) -> Sequence[Question] | None:
    """The fp8 questions of ``accel config`` (Accelerate's, for its AO backend), once fp8 was chosen."""
    if answers.get("mixed_precision") != "fp8":
        return None
    questions = [
        Question(
            "fp8_backend",
            "Which FP8 backend do you want to choose?",
            kind="select",
            choices=("AO",),
            titles=("ao (torchao float8 training)",),
            default="AO",
        ),
        Question(
            "fp8_recipe",
            "Which float8 scaling recipe do you want to use?",
            kind="select",
            choices=FP8_RECIPES,
            default="tensorwise",
        ),
        Question(
            "fp8_pad_inner_dim",
            "Do you want to pad the inner dimension of fp8 matmuls to a multiple of 16?",
            kind="confirm",
            default=False,
            help="Without it only Linear layers whose sizes are multiples of 16 run in fp8.",
        ),
    ]
    if answers.get("distributed_type") == "FSDP":
        questions.append(
            Question(
                "fp8_enable_fsdp_float8_all_gather",
                "Do you want to all-gather FSDP2 weights in fp8?",
                kind="confirm",
                default=False,
            )
        )
    return questions


def check_settings(settings: Settings) -> None:
    """Combinations that cannot work, found from the settings alone (at ``accel launch`` and in ``Kernel()``)."""
    if settings.mixed_precision != "fp8":
        return
    if settings["fp8_backend"] != "AO":
        raise UsageError(
            f"fp8_config.backend {settings['fp8_backend']} is not provided by accel-plugin-amp; "
            "use backend AO (torchao float8 training)"
        )
    if settings["cpu"] and not settings["fp8_emulate"]:
        raise UsageError(
            "mixed_precision=fp8 needs a CUDA GPU of compute capability 8.9 or newer, and the run is "
            "forced onto the CPU (--cpu/use_cpu); use bf16, or fp8_emulate to test the fp8 recipe slowly"
        )


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if settings.mixed_precision not in ("fp16", "bf16", "fp8"):
        return None
    check_settings(settings)
    from accel_amp.precision import AmpPrecision, ScaledAmpPrecision

    return ScaledAmpPrecision(settings) if settings.mixed_precision == "fp16" else AmpPrecision(settings)
