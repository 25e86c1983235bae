"""Write ``accel_accelerate.pth`` into this Python's site-packages, as the wheel of accel-accelerate installs it: an
editable install (``pip install -e compat/accelerate``, what ``make setup`` does) has no such file."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

here = Path(__file__).resolve().parent
shutil.copyfile(here / "accel_accelerate.pth", Path(sysconfig.get_paths()["purelib"]) / "accel_accelerate.pth")
