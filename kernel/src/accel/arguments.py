"""From ``Kernel(...)``'s arguments, the launch and the environment to the run's settings.

One function, :func:`resolve_arguments`, called once by ``Kernel.__init__`` after the plugins are loaded: it checks
every argument (an unknown one gets a plugin's line from ``accel_explain_name`` or Python's ``TypeError``), turns
Accelerate's dataloader arguments and kwargs handlers into accel's settings, reads what ``accel launch`` passed in
``ACCEL_CONFIG`` and resolves every declared option (argument, then launch, then environment, then default:
:func:`accel.options.resolve`).
"""

from __future__ import annotations

import base64
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accel.data_arguments import (
    DataLoaderConfiguration,
    DataSettings,
    GradientAccumulationPlugin,
    check_bool,
    resolve_data_settings,
)
from accel.errors import UsageError, user_stacklevel
from accel.options import KERNEL, Settings, did_you_mean, int_env, resolve, unread_accelerate_variables
from accel.project import ProjectConfiguration, check_project_config

if TYPE_CHECKING:
    from accel.plugins import Plugins
    from accel.utils.handlers import Routed


@dataclass
class Resolved:
    """What a Kernel takes from its arguments."""

    settings: Settings
    data: DataSettings
    handled: Routed  # the kwargs handlers' option values, the profile handler, and which handlers no plugin read


def resolve_arguments(
    plugins: Plugins,
    env: Mapping[str, str],
    *,
    mixed_precision: str | None,
    gradient_accumulation_steps: int | None,
    cpu: bool | None,
    log_with: str | Sequence[str] | None,
    project_dir: str | os.PathLike[str] | None,
    dynamo_backend: str | None,
    plugin_names: Sequence[str] | None,
    even_batches: bool | None,
    project_config: ProjectConfiguration | None,
    split_batches: bool | None,
    dataloader_config: DataLoaderConfiguration | None,
    dispatch_batches: bool | None,
    use_seedable_sampler: bool | None,
    rng_types: Sequence[Any] | None,
    device_placement: bool,
    step_scheduler_with_optimizer: bool,
    gradient_accumulation_plugin: GradientAccumulationPlugin | None,
    kwargs_handlers: Sequence[Any] | None,
    options: Mapping[str, Any],
) -> Resolved:
    """Check ``Kernel(...)``'s arguments and resolve the run's settings (see the module). Raises one line
    (``UsageError``, or ``TypeError`` for an argument nobody declares)."""
    data, gradient_accumulation_steps = resolve_data_settings(
        split_batches=split_batches,
        even_batches=even_batches,
        dataloader_config=dataloader_config,
        rng_types=rng_types,
        device_placement=device_placement,
        dispatch_batches=dispatch_batches,
        use_seedable_sampler=use_seedable_sampler,
        gradient_accumulation_plugin=gradient_accumulation_plugin,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    check_bool("Kernel(step_scheduler_with_optimizer=...)", step_scheduler_with_optimizer)
    check_project_config(project_config)
    if project_dir is None and project_config is not None:
        project_dir = project_config.project_dir
    declared = plugins.options()
    for name in options:
        if name not in declared:
            refusal = plugins.pm.hook.accel_explain_name(kind="argument", name=name)
            if refusal:
                raise UsageError(refusal)
            raise TypeError(
                f"Kernel() got an unexpected argument {name!r}{did_you_mean(name, [o.name for o in declared])}"
            )
    from accel.utils.handlers import route  # imported when a Kernel starts, not with accel

    handled = route(kwargs_handlers or (), declared, options)  # Accelerate's kwargs handlers -> plugins' options
    kwargs = {**handled.options, **options}
    for name, value in (
        ("mixed_precision", mixed_precision),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
        ("cpu", cpu),
        ("dynamo_backend", dynamo_backend),
        ("plugins", plugin_names),
        ("project_dir", None if project_dir is None else os.fspath(project_dir)),
        ("log_with", [log_with] if isinstance(log_with, str) else log_with),
    ):
        if value is not None:
            kwargs[name] = value
    values, sources = resolve(declared, env=env, launched=launched_config(env), kwargs=kwargs)
    settings = Settings(values, sources, world_size=int_env(env, "WORLD_SIZE", 1), phase="run", env=env)
    return Resolved(settings, data, handled)


def launched_config(env: Mapping[str, str]) -> Any:
    """The settings ``accel launch`` passed its workers in ``ACCEL_CONFIG`` (JSON; ``base64:`` + JSON where a
    launcher re-quotes exported values: pdsh, mpirun), or ``{}``."""
    text = env.get("ACCEL_CONFIG") or "{}"
    try:
        if text.startswith("base64:"):
            text = base64.b64decode(text[len("base64:") :], validate=True).decode()
        launched = json.loads(text)
    except ValueError:
        raise UsageError(
            "environment variable ACCEL_CONFIG is not valid JSON; unset it or launch with accel launch"
        ) from None
    return launched


def warn_arguments(kernel: Any, handled: Routed) -> None:
    """The main process's warnings about the arguments, once the components are active: kwargs-handler fields of
    plugins not active in this run, the plugin selection (unless ``accel launch`` said them: it hands
    ``ACCEL_CONFIG`` to its workers), and Accelerate's environment variables accel does not read."""
    declared = kernel.plugins.options()
    idle = handled.unused(declared, [KERNEL, *(c.name for c in kernel.components)])
    said = [] if "ACCEL_CONFIG" in os.environ else kernel.plugins.warnings
    if kernel.is_main_process:
        for message in [idle, *said, unread_accelerate_variables(os.environ, declared)]:
            if message:
                warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
