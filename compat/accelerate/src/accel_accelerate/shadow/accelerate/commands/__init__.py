"""``accelerate.commands``: the parts of Accelerate's command package that libraries import (its config file)."""
