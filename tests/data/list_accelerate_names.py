"""Write tests/data/accelerate_names.json: every argument of ``Accelerator.__init__``, every public member of
``Accelerator`` (class attributes, methods, properties, and the attributes an instance sets in ``__init__``), and
the public names of the modules ``accelerate``, ``accelerate.utils``, ``accelerate.data_loader`` and
``accelerate.state`` (what ``dir()`` shows without a leading ``_``, less submodules and the names imported from
outside Accelerate: ``os``, ``torch``, ``Callable``...).

Run it with a Python that has Accelerate installed (not accel's venv):

    /work/venvs/acc/bin/python tests/data/list_accelerate_names.py > tests/data/accelerate_names.json
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import types

os.environ.setdefault("ACCELERATE_USE_CPU", "1")

import accelerate  # noqa: E402
from accelerate import Accelerator  # noqa: E402

arguments = [name for name in inspect.signature(Accelerator.__init__).parameters if name != "self"]
members = {name for name in dir(Accelerator) if not name.startswith("_")}
members |= {name for name in vars(Accelerator(cpu=True)) if not name.startswith("_")}

MODULES = ("accelerate", "accelerate.utils", "accelerate.data_loader", "accelerate.state")


def public_names(module: types.ModuleType) -> list[str]:
    names = []
    for name in dir(module):
        obj = getattr(module, name)
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        defined_in = getattr(obj, "__module__", None)
        if isinstance(defined_in, str) and not defined_in.startswith("accelerate"):
            continue  # torch, typing, the standard library: imported, not Accelerate's
        names.append(name)
    return names


modules = {name: public_names(importlib.import_module(name)) for name in MODULES}
print(
    json.dumps(
        {"accelerate": accelerate.__version__, "arguments": arguments, "members": sorted(members), "modules": modules},
        indent=1,
    )
)
