"""accel-plugin-dynamo: the entry-point module. Cheap to import: no torch here (see ``compiler.py``).

Takes part when ``dynamo_backend`` is set to something other than ``no`` (``--dynamo_backend``,
``dynamo_config.dynamo_backend``, ``Kernel(dynamo_backend=...)``, ``ACCEL_DYNAMO_BACKEND``). Accelerate's
upper-case spellings (``INDUCTOR``, ``AOT_EAGER``, ``NO``) are accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from accel.spi import Component, Options, Question, Settings, hookimpl

NAME = "dynamo"
accel_components = ["accel_dynamo.compiler:DynamoCompiler"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@hookimpl
def accel_add_options(options: Options) -> None:
    add = options.add
    add(
        "dynamo_mode",
        default="default",
        choices=MODES,
        config_key="dynamo_config.dynamo_mode",
        env=("ACCEL_DYNAMO_MODE", "ACCELERATE_DYNAMO_MODE"),
        help="torch.compile mode (inductor only).",
    )
    add(
        "dynamo_use_fullgraph",
        type="bool",
        default=False,
        config_key="dynamo_config.dynamo_use_fullgraph",
        env=("ACCEL_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_FULLGRAPH"),
        help="torch.compile(fullgraph=True): a graph break is an error instead of a silent fallback.",
    )
    add(
        "dynamo_use_dynamic",
        type="bool",
        default=None,
        config_key="dynamo_config.dynamo_use_dynamic",
        env=("ACCEL_DYNAMO_USE_DYNAMIC", "ACCELERATE_DYNAMO_USE_DYNAMIC"),
        help="torch.compile(dynamic=True): compile for dynamic shapes; unset: torch decides after a recompile.",
    )
    add(
        "dynamo_use_regional_compilation",
        type="bool",
        default=False,
        config_key="dynamo_config.dynamo_use_regional_compilation",
        env=("ACCEL_DYNAMO_USE_REGIONAL_COMPILATION", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"),
        help="Compile each block of the model's nn.ModuleLists instead of the whole model (faster compile).",
    )


@hookimpl
def accel_config_questions(answers: Mapping[str, Any]) -> Sequence[Question] | None:
    """Accelerate's "customize the defaults sent to torch.compile" questions, once a backend was chosen."""
    if str(answers.get("dynamo_backend", "no")).lower() == "no":
        return None
    questions = [
        Question(
            "dynamo_customize",
            "Do you want to customize the defaults sent to torch.compile?",
            kind="confirm",
            default=False,
            store=False,
        )
    ]
    if answers.get("dynamo_customize"):
        questions += [
            Question("dynamo_mode", "Which mode do you want to use?", kind="select", choices=MODES, default="default"),
            Question(
                "dynamo_use_fullgraph",
                "Do you want the fullgraph mode or it is ok to break model into several subgraphs?",
                kind="confirm",
                default=False,
            ),
            Question(
                "dynamo_use_dynamic", "Do you want to enable dynamic shape tracing?", kind="confirm", default=False
            ),
            Question(
                "dynamo_use_regional_compilation",
                "Do you want to enable regional compilation?",
                kind="confirm",
                default=False,
                help="Compiles each repeated block (transformer layer) once instead of the whole model.",
            ),
        ]
    return questions


def wants_compile(settings: Settings) -> bool:
    return str(settings.get("dynamo_backend") or "no").lower() != "no"


@hookimpl
def accel_activate(settings: Settings) -> Component | None:
    if not wants_compile(settings):
        return None
    from accel_dynamo.compiler import DynamoCompiler

    return DynamoCompiler(settings)
