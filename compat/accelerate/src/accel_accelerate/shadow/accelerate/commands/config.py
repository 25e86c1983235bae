"""``accelerate.commands.config``: where Accelerate's default config file is, and reading one."""

from __future__ import annotations

import os
from typing import Any

import yaml

default_config_file = os.path.join(
    os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")),
    "accelerate",
    "default_config.yaml",
)
default_config_file = os.path.expanduser(os.environ.get("ACCELERATE_CONFIG_FILE", default_config_file))


class _Config(dict[str, Any]):
    """The file's keys, as a dict and as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def load_config_from_file(config_file: str | None = None) -> _Config:
    path = config_file or default_config_file
    with open(path, encoding="utf-8") as f:
        return _Config(yaml.safe_load(f) or {})
