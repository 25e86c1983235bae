"""The wheel carries ``accel_accelerate.pth`` at its root: Python runs it at start-up, and it puts the ``accelerate``
façade on ``sys.path`` when the switch is on (``accel_accelerate/startup.py``). An editable install has no such
file; ``make setup`` writes the same line into the venv."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file("accel_accelerate.pth", os.path.join(self.build_lib, "accel_accelerate.pth"))


setup(cmdclass={"build_py": BuildWithStartupHook})
