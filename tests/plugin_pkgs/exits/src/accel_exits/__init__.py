"""A plugin that calls sys.exit while being imported: accel must report it and keep working."""

import sys

sys.exit("accel_exits refuses to load (on purpose)")
