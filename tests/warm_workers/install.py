"""Put ``zz_accel_warm_workers.pth`` in this interpreter's site-packages (``make setup`` runs it in the dev venv): the
line that runs ``client.py`` in a process when a test session turned warm workers on and torchrun or accel launch
started it, or it may be ``accel launch`` itself. Named to come after the other ``.pth`` files (site processes them in name order), so the editable installs'
finders are in place before it runs."""

from __future__ import annotations

import sysconfig
from pathlib import Path

CLIENT = Path(__file__).resolve().parent / "client.py"
LINE = (
    "import os, sys; os.environ.get('WARM_WORKERS_DIR') "
    "and (os.environ.get('TORCHELASTIC_RUN_ID') or os.environ.get('ACCEL_CONFIG') or sys.argv[1:2] == ['launch'] "
    "or sys.orig_argv[1:3] == ['-m', 'accel.commands.launch']) "
    f"and __import__('runpy').run_path({str(CLIENT)!r})\n"
)


def main() -> None:
    target = Path(sysconfig.get_paths()["purelib"]) / "zz_accel_warm_workers.pth"
    target.write_text(LINE, encoding="utf-8")
    print(f"warm workers: {target}")


if __name__ == "__main__":
    main()
