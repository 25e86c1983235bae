"""Warm workers for the test suite: the client half (CONTRIBUTING.md, "Warm workers in the test suite").

``make setup`` puts ``zz_accel_warm_workers.pth`` in the dev venv's site-packages (``install.py``): at start-up, after
the other ``.pth`` files (the editable installs' finders), every Python process of the venv runs this file only when
``WARM_WORKERS_DIR`` is set (the test session turned warm workers on: the root conftest.py) and either
``TORCHELASTIC_RUN_ID`` or ``ACCEL_CONFIG`` is (torchrun started this process as a worker, or accel launch started it
as its one process) or it is ``accel launch`` itself (``accel launch``, ``python -m accel.commands.launch`` or
``python -m accel.commands.cli launch``, when it starts processes). It then goes on only for
``python [-u] SCRIPT ARGS`` and ``python [-u] -m NAME ARGS``.

Such a process is a fresh interpreter that has not imported torch yet. Instead of importing it (2-4 CPU seconds with
``torch._dynamo``, which the first optimizer imports), it asks a warm server (``warm_zygote.py``) that imported torch
once, under the same interpreter, flags and import-time environment, to fork a process that runs the script as this
process would: this process's argv, environment, working directory, ``sys.path``, umask and standard streams (the
file descriptors themselves are passed over the socket). It then stands in for that process: it forwards the stop
signals to it, and exits as it exited (the same code, or killed by the same signal). When this process dies, the
server kills the forked one (torchrun's SIGKILL reaches both).

Where anything differs (no server yet for this environment, other interpreter flags, ``WARM_WORKERS=0``, a
``PYTHONPATH`` folder holding a module the server already imported), the process goes on cold, as it would without
this file; the first cold worker of an environment starts the server for the next ones. Only the standard library is
imported here. (The variables' names do not start with ``ACCEL_``: the tests' environments drop accel's variables.)
"""

from __future__ import annotations

import os
import sys

#: Environment variables read when torch is imported (or by the C libraries it loads, at their load): a server
#: serves only processes whose values of these equal its own. torchrun's per-worker variables are read later.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NCCL_",
    "XLA",
    "PJRT",
    "LANG",
    "LC_",
)
RUNTIME_PREFIXES = ("TORCHELASTIC_",)
#: Single-letter interpreter flags a worker may carry (torchrun's ``-u``); anything else runs cold.
FLAGS = frozenset("uBEsOq")
#: The server's command (``python -c``), given this folder.
SERVE = "import sys; sys.path.insert(0, %r); import warm_zygote; del sys.path[0]; warm_zygote.serve()"
#: accel launch's module, which tests also run with ``python -m``
LAUNCH_MODULE = "accel.commands.launch"
#: the CLI's module: ``python -m accel.commands.cli launch ...`` is accel launch too
CLI_MODULE = "accel.commands.cli"
#: Signals passed on to the forked process (torchrun and accel stop workers with SIGTERM; accel.testing asks for
#: stacks with SIGABRT; tests send the others).
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGABRT", "SIGUSR1", "SIGUSR2")


def import_time_environment(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(RUNTIME_PREFIXES) and k != "PYTHONPATH"
    }


def base_path(env: dict[str, str]) -> list[str]:
    """``sys.path`` without the ``PYTHONPATH`` folders: the server's (the server is started without them, and the
    forked run gets this process's whole ``sys.path``)."""
    extra = {os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    return [p for p in sys.path if os.path.abspath(p) not in extra]


def server_key(flags: list[str], env: dict[str, str], base: list[str]) -> str:
    """The server that may serve a process: same interpreter, flags, import-time environment and ``sys.path``
    (``base``: without the ``PYTHONPATH`` folders, which the server checks request by request)."""
    import hashlib
    import json

    what = [sys.executable, flags, sorted(import_time_environment(env).items()), base]
    return hashlib.sha1(json.dumps(what).encode()).hexdigest()[:16]


def script_command(argv: list[str]) -> tuple[list[str], str, str, list[str]] | None:
    """``(flags, "script", SCRIPT, ARGS)`` of ``python [-FLAGS] SCRIPT ARGS``, ``(flags, "module", NAME, ARGS)`` of
    ``python [-FLAGS] -m NAME ARGS``; None for anything else (-c, -X, -W, ...)."""
    flags: list[str] = []
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            return flags, "module", argv[i + 1], argv[i + 2 :]
        if arg.startswith("-") and arg != "-":
            if len(arg) < 2 or not set(arg[1:]) <= FLAGS:
                return None
            flags.append(arg)
            continue
        return flags, "script", arg, argv[i + 1 :]
    return None


def _start_server(folder: str, key: str, flags: list[str]) -> None:
    """Start this environment's server in the background, once, when a second launch of that environment comes (an
    environment only one launch has, a test's own, is not worth a server's start)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    launch = (f"{run} {os.environ.get('MASTER_PORT')}" if run else str(os.getpid())).encode()
    seen = os.path.join(folder, key + ".seen")
    try:
        fd = os.open(seen, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        with open(seen, "rb") as f:
            if f.read() == launch:
                return
    else:
        os.write(fd, launch)
        os.close(fd)
        return
    try:
        os.close(os.open(os.path.join(folder, key + ".starting"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    import subprocess

    # Only what the key holds, the PATH and the server's own: a test's variables (accel.testing's run mark, which
    # finds a run's processes by /proc/PID/environ) must not make the server look like one of that test's processes.
    env = {k: v for k, v in os.environ.items() if k.startswith("WARM_WORKERS_") or k == "PATH"}
    env.update(import_time_environment(dict(os.environ)), WARM_WORKERS_SERVER=key)
    log = open(os.path.join(folder, key + ".log"), "ab")  # noqa: SIM115 - the server's, closed here once handed over
    with log:
        subprocess.Popen(
            [sys.executable, *flags, "-c", SERVE % os.path.dirname(os.path.abspath(__file__))],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            cwd=folder,
        )


def _stream(stream: object) -> dict[str, object] | None:
    if stream is None:
        return None
    buffer = getattr(stream, "buffer", None)
    return {
        "encoding": getattr(stream, "encoding", None),
        "errors": getattr(stream, "errors", None),
        "line_buffering": getattr(stream, "line_buffering", False),
        "write_through": getattr(stream, "write_through", False),
        "buffered": buffer is not None and type(buffer).__name__ != "FileIO",
    }


def _run_warm(folder: str, key: str, kind: str, target: str, args: list[str], base: list[str]) -> None:
    """Have the server run the script; then exit as the forked run exited. Returns when there is no server."""
    import json
    import signal
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(folder, key + ".sock"))
    except OSError:
        sock.close()
        return
    umask = os.umask(0)
    os.umask(umask)
    request = {
        "orig_argv": sys.orig_argv,
        # sys.argv as the interpreter sets it before running the script (runpy sets a module's path later)
        "argv": [target if kind == "script" else "-m", *args],
        "extra_path": [p for p in sys.path if p not in base],
        "kind": kind,
        "target": target,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "path": sys.path,
        "umask": umask,
        "streams": [_stream(sys.stdin), _stream(sys.stdout), _stream(sys.stderr)],
    }
    payload = json.dumps(request).encode()
    fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
    header = json.dumps({"size": len(payload), "fds": fds}).encode() + b"\n"
    reader = sock.makefile("rb")
    try:
        socket.send_fds(sock, [header], fds)
        sock.sendall(payload)
        first = reader.readline().split()
        if len(first) != 2 or first[0] != b"pid":  # the server refused (a shadowing PYTHONPATH folder): run cold
            sock.close()
            return
    except OSError:
        sock.close()
        return
    pid = int(first[1])

    def forward(signum: int, frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except OSError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    line = reader.readline().split()
    if len(line) != 2 or line[0] != b"exit":
        os.write(2, b"accel test warm worker: the warm server went away before the run ended\n")
        os._exit(1)
    status = int(line[1])
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # (a signal this process ignores or that does not end it)
    os._exit(os.waitstatus_to_exitcode(status))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _worker() -> bool:
    """A process torchrun started, or the one process of a single-process ``accel launch`` (``ACCEL_CONFIG``: the
    settings accel launch hands the processes it starts)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "ACCEL_CONFIG" in os.environ


def _launcher(command: tuple[list[str], str, str, list[str]]) -> bool:
    """``accel launch`` (or ``python -m accel.commands.launch``, as ``accel.testing``'s launch helpers run it, or
    ``python -m accel.commands.cli launch``) that will start processes (not a dry run, not its help), given
    :func:`script_command` of this process."""
    _flags, kind, target, args = command
    cli = (kind == "script" and os.path.basename(target) == "accel") or (kind == "module" and target == CLI_MODULE)
    if cli and args[:1] == ["launch"]:
        rest = args[1:]
    elif kind == "module" and target == LAUNCH_MODULE:
        rest = args
    else:
        return False
    return not {"--dry-run", "--dry_run", "-h", "--help"} & set(rest)


def _main() -> None:
    env = os.environ
    folder = env.get("WARM_WORKERS_DIR")
    if not folder or "WARM_WORKERS_SERVER" in env or env.get("WARM_WORKERS", "1") == "0" or "torch" in sys.modules:
        return
    command = script_command(list(getattr(sys, "orig_argv", [])))
    if command is None or not (_worker() or _launcher(command)):
        return
    flags, kind, target, args = command
    if kind == "script" and not os.path.isfile(target):
        return
    environ = dict(env)
    base = base_path(environ)
    key = server_key(flags, environ, base)
    if not os.path.exists(os.path.join(folder, key + ".sock")):
        _start_server(folder, key, flags)
        return
    _run_warm(folder, key, kind, target, args, base)


_main()
