"""Run by tests/test_launch_flags.py in an environment of its choosing (which plugins are installed): plan an
``accel launch`` (in process, nothing is started) for each argument list of a JSON file and print, per case, the
settings the flags set and the plugins taking part, or the one-line error."""

import json
import os
import sys

from accel.commands.launch import plan_launch
from accel.errors import AccelError

results = []
for argv in json.load(open(sys.argv[1])):
    try:
        plugins, plan, notices = plan_launch(argv, dict(os.environ))
    except AccelError as exc:
        results.append({"error": " ".join(str(exc).split())})
        continue
    flagged = {k: v for k, v in plan.settings.values.items() if plan.settings.sources.get(k) == "flag"}
    results.append({"flags": flagged, "active": sorted(c.name for c in plugins.components), "notices": notices})
print(json.dumps(results))
