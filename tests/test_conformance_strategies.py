"""Every strategy plugin of this repository runs accel.testing's strategy conformance suite (two real processes
over gloo): ddp, fsdp and deepspeed here; xla in its own venv (plugins/xla/tests, `make test-xla`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from clitools import EXTENSIONS

from accel.testing.conformance import StrategyConformance


class TestDDPConformance(StrategyConformance):
    name = "ddp"


class TestFSDPConformance(StrategyConformance):
    name = "fsdp"


class TestDeepSpeedConformance(StrategyConformance):
    name = "deepspeed"
    pytestmark = [pytest.mark.timeout(900)]
    backend_modules = ("deepspeed",)
    gradients_visible = False  # the engine keeps gradients in its own (partitioned) buffers: param.grad is None
    timeout = 850  # the first run on a machine builds DeepSpeed's shm op (minutes on a busy machine)

    def environment(self, tmp_path: Path) -> dict[str, str]:
        return {"TORCH_EXTENSIONS_DIR": EXTENSIONS}
