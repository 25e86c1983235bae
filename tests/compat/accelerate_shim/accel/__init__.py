"""accel's names mapped back to Accelerate's, so a port in tests/compat runs unchanged under Accelerate 1.15 (on
``PYTHONPATH`` of Accelerate's venv only; see harness.run_accelerate). The reverse of the renames the ports use:
``Kernel`` is ``Accelerator``, ``kernel.components`` stands for ``distributed_type`` (an empty list: no XLA on CPU),
``kernel.settings`` holds what the ports read of ``state``, ``Kernel(plugins=[...], <plugin options>)`` is dropped (the launch environment selects the backend under
Accelerate, as ``accelerate launch`` would)."""

from __future__ import annotations

import os
from typing import Any

from accelerate import Accelerator, DataLoaderConfiguration  # noqa: F401
from accelerate.utils import ProjectConfiguration  # noqa: F401


class Kernel(Accelerator):
    def __init__(self, *args: Any, plugins: Any = None, **kwargs: Any) -> None:
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("fsdp_", "zero_", "ddp_"))}
        super().__init__(*args, **kwargs)

    @property
    def components(self) -> list[Any]:
        return []

    def gather_object(self, obj: Any) -> list[Any]:
        """The ports call ``kernel.gather_object`` where the examples call ``accelerate.utils.gather_object``."""
        from accelerate.utils import gather_object

        return gather_object(obj)

    @property
    def settings(self) -> dict[str, Any]:
        """``state`` renamed ``settings``: what the ports read from it (the DeepSpeed config file)."""
        return {
            "deepspeed_config_file": os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None,
            "zero_stage": os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"),
        }
