"""A plugin whose import fails: accel must report it (name, distribution, error) and keep working."""

raise RuntimeError("accel_broken cannot be imported (on purpose)")
