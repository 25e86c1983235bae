"""A plugin whose accel_add_options raises: runs that do not select it must not be blocked."""

from accel import Options, hookimpl


@hookimpl
def accel_add_options(options: Options) -> None:
    options.add("badopts_level", type="int", default=1, help="Declared before the failure: must be dropped.")
    raise ValueError("badopts cannot declare its options (on purpose)")
