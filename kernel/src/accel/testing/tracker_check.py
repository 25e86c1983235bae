"""Worker of :class:`accel.testing.conformance.TrackerConformance`'s multi-process test.

``accel launch -n 2 -m accel.testing.tracker_check NAME PROJECT_DIR PROJECT INIT_KWARGS_JSON``: every process
logs the same steps; a tracker that logs on the main process only must end up with one run.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from accel import Kernel

    name, project_dir, project, init_kwargs = argv[0], argv[1], argv[2], json.loads(argv[3])
    kernel = Kernel(log_with=[name], project_dir=project_dir)
    kernel.init_trackers(project, config={"num_processes": kernel.num_processes}, init_kwargs=init_kwargs)
    for step in range(3):
        kernel.log({"loss": 1.0 / (step + 1), "process_index": kernel.process_index}, step=step)
    kernel.wait_for_everyone()
    kernel.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
