"""``accelerate.utils.deepspeed``: ``HfDeepSpeedConfig`` (a DeepSpeed configuration that transformers reads while
it builds models) and the wrapper classes. Under accel the DeepSpeed engine belongs to accel-plugin-deepspeed, and
``DummyOptim``/``DummyScheduler`` are its own (``accel.utils``); ``DeepSpeedOptimizerWrapper`` is what
``Accelerator.prepare`` returns for the engine's optimizer, as in Accelerate, and the other wrappers are refused."""

from __future__ import annotations

import json
import os
from typing import Any

from accel.errors import UsageError
from accel.prepared import PreparedOptimizer


class HfDeepSpeedConfig:
    """A DeepSpeed configuration from a dict or a JSON file, with the lookups transformers makes."""

    def __init__(self, config_file_or_dict: Any) -> None:
        if isinstance(config_file_or_dict, dict):
            config = config_file_or_dict
        elif isinstance(config_file_or_dict, str | os.PathLike) and os.path.isfile(config_file_or_dict):
            with open(config_file_or_dict, encoding="utf-8") as f:
                config = json.load(f)
        else:
            raise ValueError(
                f"expected a DeepSpeed configuration as a dict or the path of a JSON file, got {config_file_or_dict!r}"
            )
        self.config = config
        self._stage = self.get_value("zero_optimization.stage", -1)
        offload = {
            self.get_value("zero_optimization.offload_optimizer.device"),
            self.get_value("zero_optimization.offload_param.device"),
        }
        self._offload = bool(offload & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[Any, str]:
        config: Any = self.config
        *path, key = ds_key_long.split(".")
        for node in path:
            config = config.get(node)
            if config is None:
                return None, key
        return config, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        config, key = self.find_config_node(ds_key_long)
        return default if config is None else config.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        config, key = self.find_config_node(ds_key_long)
        if config is None or key not in config:
            if must_exist:
                raise ValueError(f"{ds_key_long} is not in the DeepSpeed configuration")
            return
        del config[key]

    def is_true(self, ds_key_long: str) -> bool:
        return bool(self.get_value(ds_key_long)) is True and self.get_value(ds_key_long) is not None

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return value is not None and not bool(value)

    def is_zero2(self) -> bool:
        return bool(self._stage == 2)

    def is_zero3(self) -> bool:
        return bool(self._stage == 3)

    def is_offload(self) -> bool:
        return self._offload


class _EngineOwned:
    """A wrapper Accelerate puts around DeepSpeed's objects; accel-plugin-deepspeed wraps them itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError(
            f"accelerate.utils.{type(self).__name__} is not used on accel: prepare the model, optimizer and scheduler "
            "with the Accelerator and accel-plugin-deepspeed drives the DeepSpeed engine"
        )


class DeepSpeedEngineWrapper(_EngineOwned):
    pass


class DeepSpeedOptimizerWrapper(PreparedOptimizer):
    """What ``Accelerator.prepare`` returns for the optimizer of a DeepSpeed engine, as in Accelerate: the
    Accelerator's ``backward`` steps the engine at the end of each accumulation cycle (through the Kernel's prepared
    optimizer, ``prepared``), so ``step()`` and ``zero_grad()`` here do nothing. Everything else is the optimizer's
    (``param_groups`` for a scheduler, ``state``)."""

    def __init__(self, prepared: PreparedOptimizer) -> None:
        super().__init__(prepared.kernel, prepared.optimizer)
        self.__dict__["prepared"] = prepared

    @property  # type: ignore[override]
    def step_was_skipped(self) -> bool:
        return bool(self.__dict__["prepared"].step_was_skipped)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class DeepSpeedSchedulerWrapper(_EngineOwned):
    pass


def __getattr__(name: str) -> Any:
    if name in ("DummyOptim", "DummyScheduler"):
        import accel.utils

        return getattr(accel.utils, name)
    raise AttributeError(f"module 'accelerate.utils.deepspeed' has no attribute {name!r}")
