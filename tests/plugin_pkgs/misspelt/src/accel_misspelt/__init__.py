"""A plugin with a misspelt hook name (``accel_add_option``): pluggy's check_pending() refuses it."""

from __future__ import annotations

from accel import Options, hookimpl


@hookimpl
def accel_add_option(options: Options) -> None:  # should be accel_add_options
    options.add("misspelt_flag", type="bool", default=False)
