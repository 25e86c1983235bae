"""The precision and compiler plugins of this repository run accel.testing's suites for their roles: amp for
fp16 and bf16, dynamo with the backends that need no C++ toolchain. (The launch-settings check runs for every
strategy in test_conformance_strategies.py; the launcher suite runs on the launcher template, test_new_plugin_kinds.)"""

from __future__ import annotations

from accel.testing.conformance import CompilerConformance, PrecisionConformance


class TestAmpFp16Conformance(PrecisionConformance):
    name = "amp"
    mode = "fp16"


class TestAmpBf16Conformance(PrecisionConformance):
    name = "amp"
    mode = "bf16"
    tolerance = 3e-2  # bfloat16 keeps 8 bits of mantissa


class TestDynamoConformance(CompilerConformance):
    name = "dynamo"
    backend = "aot_eager"
