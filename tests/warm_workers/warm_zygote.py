"""Warm workers for the test suite: the server half (CONTRIBUTING.md, "Warm workers in the test suite").

Started by the first cold torchrun worker of an environment (``client.py``), with that worker's interpreter,
flags and environment, less its ``PYTHONPATH``. It imports torch once, with what an optimizer's construction imports (``torch._dynamo``), runs
no tensor operation (so no thread pool exists to break a fork), and listens on ``<WARM_WORKERS_DIR>/<key>.sock``.

For each request it forks a process that becomes the requested run of ``python SCRIPT ARGS`` (or ``-m NAME``): a session of its own,
the client's standard streams (passed as file descriptors), environment, working directory, umask, ``sys.argv`` and
``sys.path`` (with the script's folder first), fresh ``__main__``, standard streams built as the client's were, the
temporary folder looked up again, NumPy's global random state reseeded (Python's ``random`` reseeds itself on fork).
Then the script runs as the interpreter would run it: an uncaught exception is printed by ``sys.excepthook`` with the
script's frames only, ``SystemExit`` ends the process with its code, and the interpreter's normal exit follows
(``atexit``, non-daemon threads joined, streams flushed).

The server reports ``pid N`` when the run starts and ``exit STATUS`` (a raw wait status) when it ended; if the client
goes away first (killed: torchrun's SIGKILL), the server kills the run's process group. It answers ``cold`` instead
when a folder of the client's ``PYTHONPATH`` holds a module of the name of one it imported (the run would get the
server's). The server exits when the test session that owns it (``WARM_WORKERS_OWNER``) is gone, or on SIGTERM,
killing what it still runs.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import json
import os
import select
import signal
import socket
import sys
from typing import Any


def _preload() -> None:
    import torch

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # imports torch._dynamo, as a worker's would
    # What the server built stays alive as long as it does, so out of the collector's reach: without this, the first
    # full collection in every forked run walked (and, touching each object's header, copied) all of torch's objects
    # again. A trivial two-process launch cost 2.7 user CPU s without this, 0.9 s with it (CONTRIBUTING.md).
    import gc

    gc.collect()
    gc.freeze()


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], dict[int, int]]:
    """The request, and the client's standard file descriptors it passed: {0: fd, 1: fd, 2: fd} (those it has)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
    head, _, rest = data.partition(b"\n")
    header = json.loads(head)
    size = header["size"]
    chunks = [rest]
    got = len(rest)
    while got < size:
        chunk = conn.recv(size - got)
        if not chunk:
            raise OSError("client went away")
        chunks.append(chunk)
        got += len(chunk)
    if len(fds) != len(header["fds"]):
        raise OSError(f"expected {len(header['fds'])} file descriptors, got {len(fds)}")
    return json.loads(b"".join(chunks)), dict(zip(header["fds"], fds, strict=True))


def _stream(fd: int, mode: str, spec: dict[str, Any] | None, name: str) -> io.TextIOWrapper | None:
    if spec is None:
        return None
    raw = io.FileIO(fd, mode, closefd=False)
    raw.name = name  # type: ignore[misc]
    buffer: Any = raw
    if spec["buffered"]:
        buffer = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffer,
        encoding=spec["encoding"],
        errors=spec["errors"],
        line_buffering=spec["line_buffering"],
        write_through=spec["write_through"],
    )


def _shadowing(folders: list[str]) -> list[str]:
    """The modules this server imported that a module in one of ``folders`` would have replaced."""
    loaded = {name.partition(".")[0] for name in sys.modules}
    found = []
    for folder in folders:
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue
        for entry in entries:
            name = entry.partition(".")[0]
            if name in loaded and (entry == name or entry.endswith((".py", ".so", ".pyc"))):
                found.append(os.path.join(folder, entry))
    return found


PR_SET_MM, PR_SET_MM_MAP = 35, 14
_kept: list[Any] = []  # the buffers /proc/PID/cmdline and /proc/PID/environ point at, alive as long as the process


def _set_mm(arg: tuple[int, int] | None = None, env: tuple[int, int] | None = None) -> bool:
    """``prctl(PR_SET_MM, PR_SET_MM_MAP)``: this process's memory map as it is, with the command line's and the
    environment's ranges moved where given. Unprivileged (Linux >= 3.18 with checkpoint/restore): the single-field
    ``PR_SET_MM_ARG_START`` and friends need CAP_SYS_RESOURCE, which containers drop."""
    import ctypes

    class MmMap(ctypes.Structure):
        _fields_ = [
            *((name, ctypes.c_uint64) for name in _MM_FIELDS),
            ("auxv", ctypes.c_void_p),
            ("auxv_size", ctypes.c_uint32),
            ("exe_fd", ctypes.c_uint32),
        ]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()

    def stat(n: int) -> int:  # field n of proc(5)'s /proc/PID/stat (the first two are before the ")")
        return int(fields[n - 3])

    arg_start, arg_end = arg or (stat(48), stat(49))
    env_start, env_end = env or (stat(50), stat(51))
    mm = MmMap(
        start_code=stat(26),
        end_code=stat(27),
        start_data=stat(45),
        end_data=stat(46),
        start_brk=stat(47),
        brk=libc.sbrk(0),
        start_stack=stat(28),
        arg_start=arg_start,
        arg_end=arg_end,
        env_start=env_start,
        env_end=env_end,
        auxv=None,
        auxv_size=0,  # auxv unchanged
        exe_fd=0xFFFFFFFF,  # executable unchanged
    )
    return libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.addressof(mm), ctypes.sizeof(mm), 0) == 0


_MM_FIELDS = (
    "start_code",
    "end_code",
    "start_data",
    "end_data",
    "start_brk",
    "brk",
    "start_stack",
    "arg_start",
    "arg_end",
    "env_start",
    "env_end",
)


def can_set_proc_strings() -> bool:
    """Whether this process may move its /proc command line and environment (tried with the ranges as they are)."""
    try:
        return _set_mm()
    except (OSError, AttributeError, ValueError, IndexError):
        return False


def _set_proc_strings(argv: list[str], env: dict[str, str]) -> None:
    """/proc/PID/cmdline and /proc/PID/environ as the client's, so tools that find a run's processes there (pgrep,
    accel.testing's run mark) find this one."""
    import ctypes

    ranges = []
    for items in (argv, [f"{k}={v}" for k, v in env.items()]):
        data = b"".join(item.encode(errors="surrogateescape") + b"\0" for item in items)
        buffer = ctypes.create_string_buffer(data, len(data))
        _kept.append(buffer)
        ranges.append((ctypes.addressof(buffer), ctypes.addressof(buffer) + len(data)))
    if not _set_mm(ranges[0], ranges[1]):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_MM_MAP) refused")


def _become(request: dict[str, Any], fds: dict[int, int]) -> None:
    """In the forked process: take on the client's process state."""
    os.setsid()
    _set_proc_strings(request["orig_argv"], request["env"])
    for target in (0, 1, 2):
        if target in fds:
            os.dup2(fds[target], target)
        else:
            os.close(target)
    for fd in fds.values():
        if fd > 2:
            os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    sys.argv = list(request["argv"])
    if request["kind"] == "script":  # the script's folder first; for -m the working directory
        first = os.path.dirname(os.path.realpath(request["target"]))
    else:
        first = os.getcwd()
    sys.path[:] = [first, *request["path"]]
    sys.path_importer_cache.clear()
    for i, (attr, mode) in enumerate((("stdin", "r"), ("stdout", "w"), ("stderr", "w"))):
        stream = _stream(i, mode, request["streams"][i], f"<{attr}>")
        setattr(sys, attr, stream)
        setattr(sys, f"__{attr}__", stream)
    import tempfile

    tempfile.tempdir = None
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if not sys.flags.no_site:  # what site.py does last, which the client left to this process
        import site

        for name in ("sitecustomize", "usercustomize") if site.ENABLE_USER_SITE else ("sitecustomize",):
            try:
                __import__(name)
            except ImportError as e:
                if e.name != name:
                    raise


def _run_script(request: dict[str, Any]) -> None:
    """Run the script (or ``-m`` module) in a fresh ``__main__``; never returns (``SystemExit`` carries the exit to
    the interpreter)."""
    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update(
        __name__="__main__",
        __doc__=None,
        __package__=None,
        __spec__=None,
        __annotations__={},
        __builtins__=builtins,
    )
    try:
        if request["kind"] == "module":  # what `python -m NAME` calls
            import runpy

            namespace["__loader__"] = importlib.machinery.BuiltinImporter
            runpy._run_module_as_main(request["target"])  # type: ignore[attr-defined]
        else:
            path = os.path.abspath(request["target"])
            namespace.update(
                __loader__=importlib.machinery.SourceFileLoader("__main__", path), __file__=path, __cached__=None
            )
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec"), namespace)
    except SystemExit:
        raise
    except KeyboardInterrupt as e:  # as the interpreter does: print it, then end by SIGINT after the normal exit
        _print_uncaught(e)
        import atexit

        atexit.register(_end_by_sigint)
        raise SystemExit(1) from None
    except BaseException as e:
        _print_uncaught(e)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _end_by_sigint() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _print_uncaught(e: BaseException) -> None:
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # this file's frames: a cold run has none
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)  # (the default hook prints the exception's own traceback)


def serve() -> None:
    folder = os.environ["WARM_WORKERS_DIR"]
    key = os.environ["WARM_WORKERS_SERVER"]
    owner = int(os.environ["WARM_WORKERS_OWNER"])
    _preload()
    if not can_set_proc_strings():  # a forked run would show the server's /proc strings: serve nobody
        print("cold for every request: prctl(PR_SET_MM_MAP) refused", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temporary = os.path.join(folder, f"{key}.{os.getpid()}.tmp")
    listener.bind(temporary)
    listener.listen(64)
    os.rename(temporary, os.path.join(folder, key + ".sock"))  # ready: clients connect from now on
    with open(os.path.join(folder, key + ".pid"), "w") as f:
        f.write(str(os.getpid()))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, _stop)
    server = os.getpid()
    try:
        _loop(listener, wake_r, wake_w, owner)
    finally:
        if os.getpid() == server:  # (a forked run's exit, SystemExit, passes through here too: not its cleanup)
            for pid in _runs:
                _kill_group(pid)
            os.unlink(os.path.join(folder, key + ".sock"))
            import resource

            own, runs = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            print(f"cpu seconds: server {own.ru_utime + own.ru_stime:.1f}, runs {runs.ru_utime + runs.ru_stime:.1f}")


class _Stopped(Exception):
    pass


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped


#: forked pid -> its client's connection
_runs: dict[int, socket.socket] = {}


def _loop(listener: socket.socket, wake_r: int, wake_w: int, owner: int) -> None:
    runs = _runs
    watched: dict[socket.socket, int] = {}  # the connections of clients still there -> their forked pid
    while True:
        try:
            readable, _, _ = select.select([listener, wake_r, *watched], [], [], 1.0)
        except _Stopped:
            return
        if not _alive(owner):
            return
        if wake_r in readable:
            os.read(wake_r, 4096)
        while runs:  # reap the runs that ended and tell their clients
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = runs.pop(pid, None)
            if conn is not None:
                watched.pop(conn, None)
                try:
                    conn.sendall(f"exit {status}\n".encode())
                except OSError:
                    pass
                conn.close()
        for conn in [c for c in readable if c in watched]:
            if not conn.recv(1):  # the client died: so does its run
                _kill_group(watched.pop(conn))
        if listener in readable:
            conn, _ = listener.accept()
            conn.settimeout(10)  # a client sends its request at once; one that does not must not stop the server
            try:
                request, fds = _read_request(conn)
                conn.settimeout(None)
            except (OSError, ValueError) as e:
                print(f"refused a request: {e}", flush=True)
                conn.close()
                continue
            shadowing = _shadowing(request["extra_path"])
            if shadowing:
                print(f"cold: {request['argv']}: PYTHONPATH shadows {shadowing[:3]}", flush=True)
                conn.sendall(b"cold\n")
                conn.close()
                for fd in fds.values():
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in runs.values():
                    other.close()
                os.close(wake_r)
                os.close(wake_w)
                _become(request, fds)
                _run_script(request)
            for fd in fds.values():
                os.close(fd)
            runs[pid] = conn
            watched[conn] = pid
            conn.sendall(f"pid {pid}\n".encode())
            print(f"run {pid}: {json.dumps(request['argv'])}", flush=True)  # (the tests read which runs were warm)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
