"""The zygote: a fork server for the tests' ``python -m fedgrid.cli ...`` processes (issue 24).

``python zygote_server.py SOCKET`` imports the heavy third-party modules a fedgrid process
loads (torch, numpy, grpc, scikit-learn, ...: about 3 s of CPU; ``--preload MODULE...`` after
``SOCKET``: those instead), listens on the Unix socket
``SOCKET`` (``SOCK_SEQPACKET``, in a 0700 folder, peers checked by ``SO_PEERCRED``: only the
process that started it), prints ``ready`` and forks one child per request. The test side is
``zygote.py``; this file imports nothing of the tests or of fedgrid.

A request is one JSON message with the child's stdin, stdout and stderr attached
(``SCM_RIGHTS``): ``{"target": ["module", NAME] | ["path", FILE], "argv": [...], "env": {...},
"cwd": DIR, "session": bool}``. The reply is ``{"pid": N}`` with a pidfd of the child attached
(the test side signals through it: never a recycled pid), or ``{"error": TEXT}``; when the
child has exited, ``{"exit": CODE}`` follows on the same connection (``-SIGNUM`` for a death
by signal, as ``Popen.returncode``) and the zygote closes its end.

What keeps a child the same as ``python -m NAME ARGV`` / ``python FILE ARGV``:

- fedgrid itself is never imported here: its modules read ``FEDGRID_*`` variables at import
  time (``fedgrid.constants``), so they are imported in the child, with the child's
  environment. Each fork checks that (no ``fedgrid`` module loaded).
- Nothing here starts a thread, a gRPC channel or a torch op before forking (the OpenMP and
  intra-op pools start in the child, which sets ``--threads``): each fork checks that this
  process has one thread (``threading`` and ``/proc/self/task``).
- The child replaces its environment (``os.environ``, hence the C environment too), working
  folder, ``sys.argv``, ``sys.path[0]`` and its three standard descriptors, starts a new
  session if asked, reseeds numpy's global generator (Python's ``random`` reseeds itself after
  a fork) and draws a multiprocessing key of its own, then runs the module or file as
  ``__main__`` with ``runpy``, the way ``-m`` does, and leaves through the interpreter's
  normal exit (``SystemExit``, atexit, thread joins).
- Everything the zygote imported is frozen (``gc.freeze``) before a fork, so the child's
  collections and exit leave those objects' pages shared instead of copying them.
- Variables the preloaded modules read at import time (``OMP_*``, ``PYTHON*``, ...) are this
  process's: the test side sends a request here only when the child's environment differs
  from this one in names that no preloaded module reads (``zygote.RUNTIME_ONLY``). Variables
  the preloaded modules set while importing (scikit-learn's ``KMP_*``) are set in the child
  as in a process that imported them. A child shares this process's hash seed.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import selectors
import socket
import struct
import sys
import threading
import time

#: What a fedgrid coordinator, client or region process imports of other packages (the
#: package's own modules are imported in the child). Measured against a client's modules at
#: its exit: torch._dynamo (which its optimizer pulls in) and FSDP alone are 1.0 s of its CPU.
PRELOAD = (
    "torch",
    "torch.utils.data",
    "torch.optim",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "torch.func",
    "torch.multiprocessing",
    "numpy",
    "grpc",
    "grpc.aio",
    "grpc_health.v1.health",
    "google.protobuf.message",
    "cryptography.x509",
    "cryptography.hazmat.primitives.asymmetric.ec",
    "cryptography.hazmat.primitives.serialization",
    "safetensors.torch",
    "xxhash",
    "zstandard",
    "tenacity",
    "sklearn.datasets",
    "sympy",
    "rich.console",
    "rich.live",
    "aiohttp",
)
#: Largest request (argv and environment), open connections, and how long a connection may
#: take to send its request.
MAX_REQUEST_BYTES = 1 << 20
MAX_CONNECTIONS = 256
REQUEST_TIMEOUT_S = 10.0


class Child:
    """What a forked child runs: the request, once this process has become the child."""

    def __init__(self, request: dict, additions: dict[str, str]) -> None:
        self.request, self.additions = request, additions

    def become(self, fds: list[int]) -> None:
        """Turns this freshly forked process into the requested one (before ``run``)."""
        request = self.request
        if request["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in self.additions.items():
            os.environ.setdefault(name, value)
        kind, name = request["target"]
        sys.argv = list(request["argv"])
        sys.path[0] = os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(name))
        importlib.invalidate_caches()
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()  # fresh entropy, as a fresh interpreter has
        if "multiprocessing.process" in sys.modules:  # its own key for its own workers' connections
            sys.modules["multiprocessing.process"].current_process().authkey = os.urandom(32)

    def run(self) -> None:
        """Runs the module or file as ``__main__``; its ``SystemExit`` ends the process."""
        kind, name = self.request["target"]
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
        sys.exit(0)


def _send(conn: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    try:
        if fds:
            socket.send_fds(conn, [data], list(fds))
        else:
            conn.send(data)
    except OSError:  # the test side went away (or stopped reading): nobody to tell
        pass


def _parse(data: bytes) -> dict:
    """The request in ``data``; ``ValueError`` naming what is wrong with it."""
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    target, argv, env = request.get("target"), request.get("argv"), request.get("env")
    if not (isinstance(target, list) and len(target) == 2 and target[0] in ("module", "path")):
        raise ValueError(f"target must be ['module', NAME] or ['path', FILE], not {target!r}")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a list of strings")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ValueError("env must map names to strings")
    if not isinstance(request.get("cwd"), str) or not isinstance(request.get("session"), bool):
        raise ValueError("cwd must be a string and session a boolean")
    return {k: request[k] for k in ("target", "argv", "env", "cwd", "session")}


def _fork_safe() -> str | None:
    """Why forking now would not be safe, or ``None``."""
    tasks = len(os.listdir("/proc/self/task"))
    if threading.active_count() != 1 or tasks != 1:
        return f"the zygote runs {threading.active_count()} Python threads and {tasks} native ones"
    loaded = sorted(m for m in sys.modules if m == "fedgrid" or m.startswith("fedgrid."))
    if loaded:
        return f"the zygote imported fedgrid modules ({', '.join(loaded[:3])}): their FEDGRID_* values are frozen"
    return None


class Zygote:
    """The accept, fork and reap loop (one thread: the only one this process has)."""

    def __init__(self, path: str, additions: dict[str, str]) -> None:
        self.additions = additions
        self.parent = os.getppid()
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(sys.stdin, selectors.EVENT_READ, "lifeline")
        self.pending: dict[socket.socket, float] = {}  # connections yet to send a request
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)

    def serve(self) -> Child | None:
        """Serves until the test process goes away (``None``); in a forked child, returns what it runs."""
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "lifeline":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return None
                elif key.data == "listen":
                    self._accept()
                elif key.data == "request":
                    child = self._request(key.fileobj)  # type: ignore[arg-type]
                    if child is not None:
                        return child
                else:
                    self._reap(key.fd)
            now = time.monotonic()
            for conn in [c for c, t in self.pending.items() if now - t > REQUEST_TIMEOUT_S]:
                self._drop(conn)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if (
            pid != self.parent
            or uid != os.getuid()
            or len(self.pending) + len(self.children) >= MAX_CONNECTIONS
        ):
            conn.close()
            return
        conn.settimeout(REQUEST_TIMEOUT_S)
        self.pending[conn] = time.monotonic()
        self.selector.register(conn, selectors.EVENT_READ, "request")

    def _drop(self, conn: socket.socket) -> None:
        self.pending.pop(conn, None)
        self.selector.unregister(conn)
        conn.close()

    def _request(self, conn: socket.socket) -> Child | None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
        except OSError:
            self._drop(conn)
            return None
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 3:
                raise ValueError(
                    f"a request is one message under {MAX_REQUEST_BYTES} bytes with 3 descriptors"
                )
            child = self._fork(conn, _parse(data), fds)
        except (ValueError, OSError) as exc:
            _send(conn, {"error": f"{type(exc).__name__}: {exc}"})
            self._drop(conn)
            child = None
        if child is None:  # here, in the zygote: the child has its own copies
            for fd in fds:
                os.close(fd)
        return child

    def _fork(self, conn: socket.socket, request: dict, fds: list[int]) -> Child | None:
        unsafe = _fork_safe()
        if unsafe is not None:
            raise OSError(f"cannot fork safely: {unsafe}")
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # what the zygote made since its last fork: untouched by the child's collections
        pid = os.fork()
        if pid == 0:
            gc.enable()
            self._close_all()
            child = Child(request, self.additions)
            child.become(fds)
            return child
        self.pending.pop(conn)
        self.selector.unregister(conn)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, "child")
        _send(conn, {"pid": pid}, (pidfd,))
        return None

    def _close_all(self) -> None:
        """In a forked child: closes everything of the zygote's (its descriptors would leak into
        the command, and an object closed later would close a reused descriptor number)."""
        self.selector.close()
        self.listener.close()
        for conn in list(self.pending):
            conn.close()
        for pidfd, (_, conn) in self.children.items():
            os.close(pidfd)
            conn.close()

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
        conn.close()


def main(path: str, preload: tuple[str, ...] = PRELOAD) -> Child | None:
    # No collections here, and everything imported frozen (gc.freeze) before a fork: a child's
    # collections and its exit then leave the zygote's objects alone instead of copying every
    # page that holds one (measured: a child's exit took 1.0 s of CPU, 0.33 s frozen).
    gc.disable()
    # pandas 3 imports pyarrow (sklearn.datasets imports pandas, and datasets brings both), whose
    # jemalloc starts a background thread when it loads: a fork would copy its locks mid-use.
    # jemalloc's own setting keeps that thread unstarted.
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    before = dict(os.environ)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional package not installed: the child imports what it needs
            pass
    additions = {k: v for k, v in os.environ.items() if k not in before}
    zygote = Zygote(path, additions)
    unsafe = _fork_safe()
    if unsafe is not None:
        raise SystemExit(f"zygote: {unsafe} after its imports (OMP_NUM_THREADS=1 keeps BLAS pools unstarted)")
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing else goes to the test side's pipe
    os.close(devnull)
    return zygote.serve()


if __name__ == "__main__":
    if sys.argv[2:3] == ["--preload"]:
        job = main(sys.argv[1], tuple(sys.argv[3:]))
    else:
        job = main(sys.argv[1])
    if job is not None:  # a forked child: the zygote's frames are gone, the command runs at top level
        job.run()
