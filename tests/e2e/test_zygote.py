"""The tests' zygote (``support/zygote.py``): a forked child is what ``python FILE`` or
``python -m MODULE`` would have been, its exit status and signals are a process's, and a zygote
that dies or is sent junk fails loudly instead of hanging."""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import zygote
from harness import child_env, wait_until
from zygote import Zygote, ZygoteError, ZygotePopen

SUPPORT = Path(__file__).resolve().parents[1] / "support"

#: What a process can tell about how it was started; ``probe ARG EXIT``.
PROBE = """
import json, os, sys

import torch

import fedgrid.constants as constants

torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
print(json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "name": __name__,
    "spec": getattr(__spec__, "name", None),
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    "rpc_timeout_s": constants.RPC_TIMEOUT_S,
    "app_var": os.environ.get("SLOW_APP_FIT_S"),
    "threads": torch.get_num_threads(),
    "product": (x @ x).sum().item(),
    "stdin": sys.stdin.read(),
}))
sys.exit(int(sys.argv[2]))
"""
SLEEPER = """
import os, sys, time
print(os.getsid(0) == os.getpid(), flush=True)
time.sleep(120)
"""


STRANGER = """
import socket
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
    conn.settimeout(30)
    conn.connect({path!r})
    try:
        socket.send_fds(conn, [b"{{}}"], [0, 1, 2])
        print("closed" if conn.recv(4096) == b"" else "answered")
    except (BrokenPipeError, ConnectionResetError):
        print("closed")
"""
RUN = dict(capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def zyg():
    z = Zygote(child_env())
    yield z
    z.close()


@pytest.mark.parametrize("form", ["file", "module"])
def test_a_forked_child_sees_what_a_fresh_interpreter_sees(zyg, tmp_path, form):
    (tmp_path / "probe.py").write_text(PROBE)
    target = [str(tmp_path / "probe.py")] if form == "file" else ["-m", "probe"]
    args = [sys.executable, *target, "1", "3"]
    # A FEDGRID_* value read when fedgrid imports, and an app's variable read when it runs.
    env = {**child_env(), "FEDGRID_RPC_TIMEOUT_S": "7.5", "SLOW_APP_FIT_S": "0.25"}
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with zyg.popen(args, **pipes, text=True, env=env, cwd=tmp_path) as forked:
        assert isinstance(forked, ZygotePopen) and forked.pid > 0
        out, err = forked.communicate("hello", timeout=120)
    fresh = subprocess.run(
        args, input="hello", capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )

    assert (forked.returncode, fresh.returncode) == (3, 3), err + fresh.stderr
    seen, expected = json.loads(out), json.loads(fresh.stdout)
    assert seen == expected
    assert seen["rpc_timeout_s"] == 7.5 and seen["app_var"] == "0.25" and seen["stdin"] == "hello"
    assert seen["fds"] == [0, 1, 2, 3]  # the three it was given, and the listing's own
    assert seen["path0"] == str(tmp_path) and seen["threads"] == 1


def test_exit_statuses_signals_and_timeouts_are_a_processs(zyg, tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    args = [sys.executable, str(tmp_path / "sleeper.py")]
    for session in (False, True):
        child = zyg.popen(args, stdout=subprocess.PIPE, text=True, env=child_env(), start_new_session=session)
        assert child.stdout is not None
        assert child.stdout.readline() == f"{session}\n"  # its own session only when asked
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.2)
        child.terminate()
        assert child.wait(timeout=60) == -signal.SIGTERM
        child.kill()  # a no-op once it has exited, as for Popen
        assert child.returncode == -signal.SIGTERM
        child.stdout.close()


def test_only_what_a_fork_reproduces_goes_to_the_zygote(zyg, tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text("")
    python = [sys.executable, str(script)]
    assert zygote.request_for(python, {}) is not None
    assert zygote.request_for(python, {"pass_fds": (5,)}) is None
    assert zygote.request_for(python, {"close_fds": False}) is None
    assert zygote.request_for(["/bin/true"], {}) is None
    assert zygote.request_for([sys.executable, "-c", "pass"], {}) is None
    assert zygote.request_for([sys.executable, str(tmp_path / "missing.py")], {}) is None
    assert zygote.request_for(python, {"cwd": tmp_path / "missing"}) is None
    # A console script of this environment is a Python file too; another program without a suffix is not.
    console = Path(sys.executable).with_name("fedgrid")
    assert zygote.request_for([sys.executable, str(console), "--version"], {})["target"] == [
        "path",
        str(console),
    ]
    (tmp_path / "tool").write_text("#!/bin/sh\necho hi\n")
    assert zygote.request_for([sys.executable, str(tmp_path / "tool")], {}) is None
    with pytest.raises(
        ValueError, match="cannot start"
    ):  # torch read OMP_NUM_THREADS when the zygote imported it
        zyg.popen(python, env={**child_env(), "OMP_NUM_THREADS": "2"})
    monkeypatch.setenv("FEDGRID_TEST_ZYGOTE", "0")
    with zygote.popen(python, env=child_env()) as real:
        assert type(real) is subprocess.Popen
        assert real.wait(timeout=120) == 0


def test_a_dead_zygote_fails_the_wait_and_the_next_start(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    args = [sys.executable, str(tmp_path / "sleeper.py")]
    doomed = Zygote(child_env(), preload=())  # its child imports nothing: no need of torch's seconds
    child = doomed.popen(args, stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert child.stdout is not None and child.stdout.readline() == "False\n"
        doomed.proc.kill()
        assert doomed.proc.wait(timeout=30) == -signal.SIGKILL  # dead, and reaped
        with pytest.raises(ZygoteError, match="without its exit"):
            child.wait(timeout=60)
        with pytest.raises(ZygoteError, match="exited with -9"):
            doomed.popen(args, env=child_env())
    finally:
        os.kill(child.pid, signal.SIGKILL)  # the orphan, adopted by init
        child.stdout.close()
        doomed.close()


def _ask(path: str, payload: bytes, fds: list[int]) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(30)
        conn.connect(path)
        socket.send_fds(conn, [payload], fds)
        return conn.recv(4096)


def test_the_zygote_refuses_junk_and_strangers(zyg):
    std = [0, 1, 2]
    assert json.loads(_ask(zyg.path, b"not json", std))["error"].startswith("JSONDecodeError")
    assert "3 descriptors" in json.loads(_ask(zyg.path, b"{}", [0]))["error"]
    bad_target = json.dumps({"target": ["shell", "ls"], "argv": [], "env": {}, "cwd": "/", "session": False})
    assert "target must be" in json.loads(_ask(zyg.path, bad_target.encode(), std))["error"]
    # Another process of this user: the zygote answers only the process that started it.
    stranger = subprocess.run([sys.executable, "-c", STRANGER.format(path=zyg.path)], **RUN)
    assert stranger.stdout == "closed\n", stranger.stderr


def test_the_zygote_forks_only_with_one_thread_and_no_fedgrid():
    check = "import sys, zygote_server as z; {setup}; print(z._fork_safe())"
    cases = {
        "import threading, time; threading.Thread(target=time.sleep, args=(3,)).start()": "2 Python threads",
        "import fedgrid.constants": "imported fedgrid modules (fedgrid, fedgrid.constants",
        "pass": "None",
    }
    for setup, expected in cases.items():
        env = {**child_env(), "PYTHONPATH": str(SUPPORT)}
        done = subprocess.run([sys.executable, "-c", check.format(setup=setup)], env=env, **RUN)
        assert expected in done.stdout, done.stderr


def test_each_environment_gets_its_own_zygote_up_to_a_cap(tmp_path, monkeypatch):
    """A variable an import may read (any but ``RUNTIME_ONLY``'s) picks another zygote; one set
    only at run time (``KMP_*``, ``MASTER_PORT``) does not; past ``MAX_ZYGOTES`` a real process
    starts."""
    monkeypatch.setattr(zygote, "_zygotes", {})  # this test's own, closed at its end
    # Zygotes that preload nothing: the choice among them is the subject, not what they import.
    monkeypatch.setattr(zygote, "Zygote", functools.partial(Zygote, preload=()))
    monkeypatch.setattr(zygote, "MAX_ZYGOTES", 2)
    monkeypatch.setattr(zygote, "counts", {"forked": 0, "real": 0})
    script = tmp_path / "ppid.py"
    script.write_text("import os\nprint(os.getppid(), os.environ['TAG'])\n")
    base = child_env()
    envs = [
        {**base, "TAG": "a"},
        {**base, "TAG": "b"},
        {**base, "TAG": "a", "KMP_INIT_AT_FORK": "FALSE", "MASTER_PORT": "29500"},
        {**base, "TAG": "c"},
    ]
    try:
        done = [
            zygote.run([sys.executable, str(script)], capture_output=True, text=True, env=e, timeout=120)
            for e in envs
        ]
        pids = [zyg.proc.pid for zyg in zygote._zygotes.values()]
        assert len(pids) == 2
        assert [d.stdout.split() for d in done[:3]] == [
            [str(pids[0]), "a"],
            [str(pids[1]), "b"],
            [str(pids[0]), "a"],
        ]
        assert done[3].stdout.split() == [str(os.getpid()), "c"]  # a real child of this process
        assert zygote.counts == {"forked": 3, "real": 1}
    finally:
        for zyg in zygote._zygotes.values():
            zyg.close()


def test_a_child_dropped_while_running_is_reaped_by_later_starts(zyg, tmp_path):
    """``subprocess`` keeps a ``Popen`` collected while its child runs, and every later start polls
    it (``subprocess._cleanup``): that poll must still work, and see the exit once it comes."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "done.py").write_text("")
    child = zyg.popen(
        [sys.executable, str(tmp_path / "sleeper.py")], stdout=subprocess.DEVNULL, env=child_env()
    )
    pid = child.pid
    del child
    gc.collect()
    assert pid in [p.pid for p in subprocess._active]  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGKILL)

    def reaped() -> bool:
        with zyg.popen([sys.executable, str(tmp_path / "done.py")], env=child_env()) as other:
            assert other.wait(timeout=60) == 0
        return pid not in [p.pid for p in subprocess._active]  # type: ignore[attr-defined]

    wait_until(reaped, timeout=60, what="the dropped child's exit to be polled")
