"""Code that mypy found wrong (``make lint``), pinned by its behaviour: an object with a hook that has no spec,
registered into the plugin manager outside discovery, is named in one PluginError (the code read
``PluginValidationError.plugin_name``, which pluggy does not have, and died with an AttributeError); accel-plugin-ipex
still pairs each model with its one optimizer, and says why it cannot, after its checks were reordered for types."""

from __future__ import annotations

import pytest
import torch

from accel import PluginError, Settings, UsageError, hookimpl
from accel.options import resolve
from accel.plugins import Plugins
from accel_ipex.optimizer import pair_models_and_optimizers


class Stray:
    @hookimpl
    def accel_not_a_hook(self) -> None: ...


def test_a_registered_object_with_an_unknown_hook_is_named_in_a_plugin_error() -> None:
    plugins = Plugins.load(env={"ACCEL_PLUGINS": ""})
    plugins.pm.register(Stray(), name="stray")
    values, sources = resolve(plugins.options(), kwargs={}, env={})
    with pytest.raises(PluginError, match=r"^plugin 'stray': unknown hook 'accel_not_a_hook'"):
        plugins.activate(Settings(values, sources, world_size=1, phase="run", env={}))


def sgd(*modules: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)


def test_ipex_pairs_each_model_with_its_one_optimizer() -> None:
    a, b, c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert pair_models_and_optimizers([a, b, c], [sgd(c), sgd(a)]) == {0: 1, 1: None, 2: 0}
    cases = [
        ([sgd(torch.nn.Linear(2, 2))], "optimizer SGD was prepared without its model"),
        ([sgd(a, b)], "optimizer SGD holds parameters of 2 models"),
        ([sgd(a, torch.nn.Linear(2, 2))], "optimizer SGD holds parameters of models prepared in other calls"),
        ([sgd(a), sgd(a)], "model Linear has two optimizers"),
    ]
    for optimizers, message in cases:
        with pytest.raises(UsageError, match=f"^plugin 'ipex': {message}"):
            pair_models_and_optimizers([a, b], optimizers)
