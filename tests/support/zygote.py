"""Start ``python -m fedgrid.cli ...`` processes without paying for their imports (issue 24).

Each fedgrid process a test starts spends about 2 s of CPU importing torch, grpc and the rest
before it does anything; the e2e tier starts hundreds. ``popen`` and ``run`` take the
arguments of ``subprocess.Popen`` and ``subprocess.run``; for a command
``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, FILE.py, ...]`` (or a console script
of this environment instead of ``FILE.py``: ``bin/fedgrid``) they fork it from
a zygote (``zygote_server.py``: one per test process, started on first use, that has imported
those modules once) and return a ``subprocess.Popen`` whose ``pid``, ``poll``, ``wait``,
``communicate``, ``send_signal``, ``terminate``, ``kill``, ``returncode`` and pipes behave as
a started process's. Anything else (other programs, options such as ``pass_fds`` or
``preexec_fn``, an environment that differs from the zygote's in a variable read at import
time) starts a real process, as does everything when ``FEDGRID_TEST_ZYGOTE=0`` or off Linux.

A zygote that dies or stops answering fails the call that needed it (``ZygoteError``, with
the zygote's log): every read of its socket has a deadline.

Keep off the zygote what must be a fresh interpreter: import-cost checks, ``fedgrid launch``
(which starts its own children; theirs are real processes either way), torchrun.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "popen",
    "run",
    "request_for",
    "comparable",
    "Zygote",
    "ZygoteError",
    "ZygotePopen",
    "RUNTIME_ONLY",
]

SERVER = Path(__file__).with_name("zygote_server.py")
#: Variables that may differ between the zygote and a child it forks: none of the modules the
#: zygote imports reads them (fedgrid, which reads ``FEDGRID_*`` at import time, is imported in
#: the child; the apps in ``apps/`` read theirs when they run; pytest's are pytest's).
#: Set inside a test process by what it ran, and read only when used, never by the zygote's
#: imports: torch.distributed's rendezvous and socket variables (set by in-process DDP tests and
#: ``client/parallel.py``), the Hugging Face Hub's (``simulation/language.py``; the hub is not
#: preloaded), the OpenMP runtime's that importing scikit-learn sets (the zygote imports it too).
RUNTIME_ONLY = (
    *("FEDGRID_", "PYTEST_", "SLOW_APP_", "SLOW_EVAL_S"),
    *("GLOO_", "NCCL_", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "HF_", "TRANSFORMERS_", "KMP_"),
)
#: At most this many zygotes per test process, one per environment (see ``comparable``).
MAX_ZYGOTES = 3
#: ``Popen`` arguments a forked child honours; any other sends the command to a real process.
SUPPORTED = frozenset(
    {"stdin", "stdout", "stderr", "env", "cwd", "text", "universal_newlines", "encoding", "errors", "bufsize"}
    | {"start_new_session", "close_fds"}
)
START_TIMEOUT_S = 120.0  # the zygote's imports, on a loaded machine
REPLY_TIMEOUT_S = 30.0  # a fork, or an exit report once the child is gone
SLICE_S = 1.0  # a wait re-checks the zygote this often
MAX_REQUEST_BYTES = 1 << 20


class ZygoteError(RuntimeError):
    """The zygote died, refused a request or stopped answering."""


class Zygote:
    """The zygote process of this test process, and its socket.

    ``preload``: the modules it imports before forking, instead of ``zygote_server.PRELOAD``
    (a test of the zygote's bookkeeping, whose children import nothing heavy, starts one that
    preloads nothing: each full start costs seconds of CPU).
    """

    def __init__(self, env: dict[str, str], *, preload: Sequence[str] | None = None) -> None:
        self.env = comparable(env)  # what it runs with: the variables its imports may read
        self.dir = tempfile.mkdtemp(prefix="fedgrid-zygote-")  # 0700: this user's alone
        self.path = os.path.join(self.dir, "socket")
        self.log_path = os.path.join(self.dir, "log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(SERVER),
                    self.path,
                    *([] if preload is None else ["--preload", *preload]),
                ],
                stdin=subprocess.PIPE,  # its lifeline: it exits when this process does
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                cwd=self.dir,
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if line != b"ready\n":
            self.proc.kill()
            self.proc.wait()
            raise ZygoteError(f"the zygote did not start within {START_TIMEOUT_S}s: {self.log()}")
        atexit.register(self.close)

    def log(self) -> str:
        """The state of the zygote and the end of its log, for an error message."""
        try:  # a zygote that just failed a request may be dying: its exit status says why
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        try:
            text = Path(self.log_path).read_text(errors="replace")[-3000:]
        except OSError as exc:
            text = f"(log unreadable: {exc})"
        return f"zygote {self.proc.pid} {state}; its log:\n{text}"

    def spawn(self, request: dict[str, Any], fds: Sequence[int]) -> tuple[socket.socket, int, int]:
        """Forks the child ``request`` describes with ``fds`` as its stdin, stdout and stderr;
        returns the connection its exit report comes on, its pid and a pidfd of it."""
        payload = json.dumps(request).encode()
        if len(payload) > MAX_REQUEST_BYTES:
            raise ValueError(f"argv and environment take {len(payload)} bytes, over {MAX_REQUEST_BYTES}")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(REPLY_TIMEOUT_S)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [payload], list(fds))
            data, pidfds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
        except OSError as exc:
            conn.close()
            raise ZygoteError(
                f"no answer from the zygote to {request['argv']}: {exc!r}; {self.log()}"
            ) from exc
        reply = json.loads(data) if data else {"error": "it closed the connection"}
        if "error" in reply or len(pidfds) != 1:
            conn.close()
            for fd in pidfds:
                os.close(fd)
            raise ZygoteError(
                f"the zygote did not start {request['argv']}: {reply.get('error')}; {self.log()}"
            )
        return conn, int(reply["pid"]), pidfds[0]

    def popen(self, args: Sequence[Any], **kwargs: Any) -> ZygotePopen:
        """``subprocess.Popen(args, **kwargs)``, forked; ``ValueError`` when only a real
        process would do the same (see ``request_for``)."""
        request = request_for(args, kwargs)
        if request is None or comparable(request["env"]) != self.env:
            raise ValueError(f"the zygote cannot start {args!r} with these options or this environment")
        return ZygotePopen(args, zygote=self, request=request, **kwargs)

    def close(self) -> None:
        """Ends the zygote (its children run on) and removes its folder."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class ZygotePopen(subprocess.Popen):
    """A ``subprocess.Popen`` whose process the zygote forked (its parent is the zygote, which
    reports its exit status; signals go through a pidfd, so never to a recycled pid)."""

    def __init__(
        self, args: Sequence[str], *, zygote: Zygote, request: dict[str, Any], **kwargs: Any
    ) -> None:
        self._zygote, self._request = zygote, request
        self._conn: socket.socket | None = None
        self._pidfd = -1
        self._gone_since: float | None = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest) -> None:
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = rest[3:9]
        fds = [fd if fd != -1 else default for fd, default in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        try:
            self._conn, self.pid, self._pidfd = self._zygote.spawn(self._request, fds)
        finally:  # the child has its copies; ours would keep its pipes open
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._child_created = True

    def _receive(self, timeout: float) -> None:
        """Takes the exit report if it comes within ``timeout`` s (the caller holds the lock)."""
        assert self._conn is not None
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(1 << 12)
        except (BlockingIOError, TimeoutError):
            self._check_zygote()
            return
        except OSError as exc:
            raise ZygoteError(
                f"lost the zygote's report on {self.pid}: {exc!r}; {self._zygote.log()}"
            ) from exc
        if not data:
            raise ZygoteError(
                f"the zygote closed {self.pid}'s connection without its exit; {self._zygote.log()}"
            )
        self.returncode = int(json.loads(data)["exit"])
        self._conn.close()

    def _check_zygote(self) -> None:
        """Fails when the child is gone and the zygote has not said so within ``REPLY_TIMEOUT_S``."""
        if self._pidfd == -1 or not select.select([self._pidfd], [], [], 0)[0]:
            return
        now = time.monotonic()
        self._gone_since = self._gone_since or now
        if now - self._gone_since > REPLY_TIMEOUT_S:
            raise ZygoteError(f"{self.pid} exited {REPLY_TIMEOUT_S}s ago, unreported; {self._zygote.log()}")

    def _internal_poll(self, _deadstate=None, **_: Any):  # type: ignore[override]
        if self.returncode is None and self._conn is not None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    self._receive(0.0)
            except ZygoteError:
                if _deadstate is None:
                    raise
                self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        if _deadstate is not None and self.returncode is not None:
            self._close_pidfd()  # polled by __del__ or subprocess._cleanup: nobody signals it again
        return self.returncode

    def _wait(self, timeout):  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            step = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
            if step <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if self._waitpid_lock.acquire(timeout=step):
                try:
                    if self.returncode is None:
                        self._receive(step)
                finally:
                    self._waitpid_lock.release()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.poll()
        if self.returncode is not None:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:  # exited since the poll
            pass

    def _close_pidfd(self) -> None:
        if self._pidfd != -1:
            os.close(self._pidfd)
            self._pidfd = -1

    def __del__(self, *args: Any) -> None:
        # A child still running goes to subprocess's ``_active`` list, and each later ``Popen``
        # polls it (``subprocess._cleanup``): its pidfd stays open until that poll sees its exit.
        super().__del__(*args)


_zygotes: dict[frozenset[tuple[str, str]], Zygote] = {}
_lock = threading.Lock()
#: How the processes of this test process started: ``forked`` from a zygote, or as ``real``
#: processes because the environment differed from every zygote's (MAX_ZYGOTES were running).
counts = {"forked": 0, "real": 0}


def comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(RUNTIME_ONLY)}


def request_for(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """What the zygote would run for ``Popen(args, **kwargs)``, or ``None`` when only a real
    process does the same: not ``python -m MODULE`` or ``python FILE.py``, an option a fork
    does not honour, a missing folder or file (``Popen`` says what is missing)."""
    if set(kwargs) - SUPPORTED:
        return None
    if not kwargs.get("close_fds", True) or isinstance(args, (str, bytes)):
        return None
    argv = [os.fspath(a) for a in args]
    cwd = os.fspath(kwargs.get("cwd") or os.getcwd())
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    if len(argv) < 2 or argv[0] != sys.executable or not os.path.isdir(cwd):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    if argv[1] == "-m" and len(argv) > 2 and not argv[2].startswith("-"):
        target, child_argv = ["module", argv[2]], ["-m", *argv[3:]]
    elif _is_script(os.path.join(cwd, argv[1])):
        target, child_argv = ["path", argv[1]], argv[1:]
    else:
        return None
    session = bool(kwargs.get("start_new_session", False))
    return {"target": target, "argv": child_argv, "env": env, "cwd": cwd, "session": session}


def _is_script(path: str) -> bool:
    """A Python file ``python PATH`` runs as ``__main__``: a ``.py`` file, or a console script
    of this environment (``bin/fedgrid``: no suffix, its first line ``#!`` this interpreter)."""
    if not os.path.isfile(path):
        return False
    if path.endswith(".py"):
        return True
    with open(path, "rb") as f:
        return f.readline().rstrip() == b"#!" + os.fsencode(sys.executable)


def _zygote_for(env: dict[str, str]) -> Zygote | None:
    """The zygote of ``env``'s variables that imports may read (``comparable``), started on
    first use; ``None`` when MAX_ZYGOTES of other environments run."""
    key = frozenset(comparable(env).items())
    with _lock:
        if key not in _zygotes and len(_zygotes) < MAX_ZYGOTES:
            _zygotes[key] = Zygote(env)
        zygote = _zygotes.get(key)
        counts["real" if zygote is None else "forked"] += 1
        return zygote


def popen(args: Sequence[Any], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``, forked from the zygote when that is the same."""
    off = os.environ.get("FEDGRID_TEST_ZYGOTE") == "0" or sys.platform != "linux"  # pidfds, /proc
    request = None if off else request_for(args, kwargs)
    zygote = None if request is None else _zygote_for(request["env"])
    return subprocess.Popen(args, **kwargs) if zygote is None else zygote.popen(args, **kwargs)


def run(
    args: Sequence[Any],
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)`` with the process from ``popen``."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
        if check and code:
            raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)
