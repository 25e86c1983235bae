"""Write tests/data/accelerate_names.json: every argument of ``Accelerator.__init__`` and every public member of
``Accelerator`` (class attributes, methods, properties, and the attributes an instance sets in ``__init__``).

Run it with a Python that has Accelerate installed (not accel's venv):

    /work/venvs/acc/bin/python tests/data/list_accelerate_names.py > tests/data/accelerate_names.json
"""

from __future__ import annotations

import inspect
import json
import os

os.environ.setdefault("ACCELERATE_USE_CPU", "1")

import accelerate  # noqa: E402
from accelerate import Accelerator  # noqa: E402

arguments = [name for name in inspect.signature(Accelerator.__init__).parameters if name != "self"]
members = {name for name in dir(Accelerator) if not name.startswith("_")}
members |= {name for name in vars(Accelerator(cpu=True)) if not name.startswith("_")}
print(json.dumps({"accelerate": accelerate.__version__, "arguments": arguments, "members": sorted(members)}, indent=1))
