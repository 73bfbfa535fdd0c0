"""A Docker engine and fedgrid's image for the sites tier (``tests/sites/``, ``make test-sites``).

- ``Engine.ensure``: the engine that answers, or, as root, Debian's ``docker.io`` (installed
  when missing) started here; ``Engine.stop`` stops only a daemon this module started.
- ``base_image``: the image docker/Dockerfile builds on. ``python:3.11-slim`` where it is
  here or Docker Hub answers; otherwise a Debian made with ``debootstrap --variant=minbase``
  and ``docker import``, kept in the engine for the next run.
- ``build_image``: docker/Dockerfile, built from the repository's root (its
  ``Dockerfile.dockerignore`` filters the context) with BuildKit, torch from the CPU wheel on
  this machine's disk (pip's find-links), never a CUDA build. BuildKit's cache makes a rebuild
  of unchanged sources take seconds.

Everything here is idempotent: a second run reuses the engine, the base and the layers.
"""

from __future__ import annotations

import configparser
import ipaddress
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
#: What the Dockerfile's pip steps mount: torch's wheel when TORCH_INDEX is empty, and a CA
#: bundle (docker/pip/README.md).
PIP_FOLDER = ROOT / "docker" / "pip"
#: The base where Docker Hub cannot be reached: Debian's own packages, made once and kept.
DEBIAN_BASE = "fedgrid-sites-base:bookworm"
HUB_BASE = "python:3.11-slim"
#: Debian's CLI: it builds with the engine's own BuildKit (DOCKER_BUILDKIT=1). A newer CLI
#: without the buildx plugin (one is at /usr/local/bin here) refuses BuildKit builds.
DEBIAN_CLI = Path("/usr/bin/docker")


class EngineUnavailable(RuntimeError):
    """No Docker engine answers and this user cannot start one (not root): the tier is skipped
    saying so. Any other failure to install or start one fails the tier."""


def docker_cli() -> str:
    found = str(DEBIAN_CLI) if DEBIAN_CLI.exists() else shutil.which("docker")
    if found is None:
        raise EngineUnavailable("no docker command (Debian's docker.io provides one)")
    return found


def docker(*args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    """``docker ARGS``; a failure raises with the command's output."""
    done = subprocess.run([docker_cli(), *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-3000:]}")
    return done


def _answers() -> bool:
    if not (DEBIAN_CLI.exists() or shutil.which("docker")):
        return False
    try:
        return docker("version", "--format", "{{.Server.Version}}", timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Another apt (a session's, a CI step's) may hold dpkg's lock: wait for it rather than fail.
    wait = ["-o", "DPkg::Lock::Timeout=300"]
    for argv in (["apt-get", *wait, "update", "-q"], ["apt-get", *wait, "install", "-y", "-q", *packages]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")


@dataclass
class Engine:
    """The engine the tier uses. ``process``: the dockerd this module started (``None``: one that
    was already running, left alone). ``forwarding``: ``net.ipv4.ip_forward`` before it started."""

    process: subprocess.Popen | None = None
    log: Path | None = None
    forwarding: str | None = None

    @classmethod
    def ensure(cls, log: Path, *, timeout: float = 90) -> "Engine":
        """The engine that answers, or one started from Debian's ``docker.io`` (installed when
        missing). Raises ``EngineUnavailable`` without root; ``RuntimeError`` with dockerd's log when it fails."""
        if _answers():
            return cls()
        if os.geteuid() != 0:
            raise EngineUnavailable("no Docker engine answers, and starting one (dockerd) needs root")
        if not (shutil.which("dockerd") and DEBIAN_CLI.exists()):
            _apt_install("docker.io")
        # Forwarding on before dockerd starts: a dockerd that turns it on itself also sets the
        # FORWARD chain's policy to DROP, which would cut other network namespaces' bridged
        # traffic on this machine (the lab's). It is put back by ``stop``.
        sysctl = Path("/proc/sys/net/ipv4/ip_forward")
        forwarding = sysctl.read_text().strip()
        sysctl.write_text("1\n")
        out = open(log, "ab")
        process = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        engine = cls(process, log, forwarding)
        try:
            wait_until(
                lambda: process.poll() is not None or _answers(),
                timeout=timeout,
                what="dockerd",
                interval=0.5,
            )
        except AssertionError:
            pass  # named below, with dockerd's log
        if process.poll() is not None or not _answers():
            engine.stop()
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"dockerd did not answer within {timeout:.0f} s; its log ({log}):\n{tail}")
        return engine

    def stop(self, *, timeout: float = 60) -> None:
        """Stops the dockerd this module started (SIGTERM: it stops its containers and its
        containerd), and puts forwarding back; an engine found running is left alone."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        if self.forwarding is not None:
            Path("/proc/sys/net/ipv4/ip_forward").write_text(self.forwarding + "\n")
        self.process = None


def host_address() -> str:
    """An address of this host that every container reaches whatever its network (the default
    bridge's, docker0's): the address a site dials for another site's published port, as it would
    dial another host's."""
    done = subprocess.run(["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True, text=True)
    found = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", done.stdout)
    if found is None:
        raise RuntimeError(f"docker0 has no IPv4 address: {done.stdout or done.stderr}")
    return str(ipaddress.ip_address(found.group(1)))


def _image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False, timeout=30).returncode == 0


def base_image(*, pull_timeout: float = 120) -> str:
    """The base docker/Dockerfile builds on: ``python:3.11-slim`` when it is here or can be
    pulled; else Debian with its Python made by debootstrap (about 40 s, once: the image stays in
    the engine; a base made before without Python still builds: the Dockerfile installs it)."""
    if _image_exists(HUB_BASE) or _image_exists(DEBIAN_BASE):
        return HUB_BASE if _image_exists(HUB_BASE) else DEBIAN_BASE
    try:
        if docker("pull", "-q", HUB_BASE, timeout=pull_timeout, check=False).returncode == 0:
            return HUB_BASE
    except subprocess.TimeoutExpired:
        pass
    if shutil.which("debootstrap") is None:
        _apt_install("debootstrap")
    with tempfile.TemporaryDirectory(prefix="fedgrid-debootstrap-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        done = subprocess.run(
            # Python with it, in the same download: the image's build then finds python3 -m venv
            # working and skips its own apt-get update and install (the step for bases without Python).
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv",
                "bookworm",
                str(rootfs),
                "http://deb.debian.org/debian",
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"debootstrap exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        # What apt fetched to install the base (the image's own apt-get update fetches it anew),
        # and documentation and translations no container reads (51 MB): the slim images' cut.
        for leftovers in (
            "var/cache/apt",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/locale",
        ):
            for path in (rootfs / leftovers).rglob("*"):
                if path.is_file() or path.is_symlink():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        docker("import", "-", DEBIAN_BASE, stdin=tar.stdout, timeout=300)
        if tar.wait(60) != 0:
            raise RuntimeError("tar of the debootstrap tree failed")
    return DEBIAN_BASE


def pip_settings(name: str) -> list[str]:
    """The values of pip's setting ``name`` here (``find-links``, ``cert``): ``PIP_NAME`` and
    pip's configuration files, in the order pip reads them (the environment last: it wins)."""
    found: list[str] = []
    files = [Path("/etc/xdg/pip/pip.conf"), Path("/etc/pip.conf"), Path.home() / ".config/pip/pip.conf"]
    files += [Path(os.environ["PIP_CONFIG_FILE"])] if os.environ.get("PIP_CONFIG_FILE") else []
    for path in files:
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        for section in parser.sections():
            found += parser.get(section, name, fallback="").split()
    return found + os.environ.get(f"PIP_{name.upper().replace('-', '_')}", "").split()


def torch_cpu_wheel(version: str) -> Path | None:
    """torch ``version``'s CPU wheel for CPython 3.11 (the image's Python) on this machine's disk."""
    folders = [Path(p.removeprefix("file://")) for p in pip_settings("find-links") if "://" not in p[:8]]
    for folder in folders:
        for wheel in sorted(folder.glob(f"torch-{version}+cpu-cp311-cp311-*x86_64.whl")):
            return wheel
    return None


def dockerfile_arg(name: str) -> str:
    """An ``ARG NAME=default`` of docker/Dockerfile."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    found = re.search(rf"^ARG {name}=(\S*)$", text, flags=re.M)
    assert found is not None, name
    return found.group(1)


def build_image(tag: str, *, base: str, log: Path, timeout: float = 900) -> None:
    """``docker build -f docker/Dockerfile -t TAG .`` on ``base``. The pip steps get this machine's
    CPU wheel of torch, where it has one, and the CA bundle its pip trusts (``cert``: a proxy that
    re-signs TLS), placed in docker/pip/ for the build and removed after. The output goes to
    ``log``; a failure raises with the output's end."""
    wheel = torch_cpu_wheel(dockerfile_arg("TORCH_VERSION"))
    certs = [Path(c) for c in pip_settings("cert") if Path(c).is_file()]
    args = ["--build-arg", f"BASE_IMAGE={base}"] + (["--build-arg", "TORCH_INDEX="] if wheel else [])
    placed = [(wheel, PIP_FOLDER / wheel.name)] if wheel else []
    placed += [(certs[-1], PIP_FOLDER / "ca.pem")] if certs else []
    try:
        for source, target in placed:
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
            except OSError:  # another filesystem
                shutil.copyfile(source, target)
        with open(log, "w") as out:
            # --network host: the build's steps reach Debian's and PyPI's registries as this host does.
            done = subprocess.run(
                [docker_cli(), "build", "--progress", "plain", "--network", "host", *args]
                + ["-f", "docker/Dockerfile", "-t", tag, "."],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "DOCKER_BUILDKIT": "1"},
                timeout=timeout,
            )
    finally:
        for _, target in placed:
            target.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"docker build exited {done.returncode}; its log ({log}) ends:\n{log.read_text()[-4000:]}"
        )


def build_layer(tag: str, dockerfile: str, *, timeout: float = 300) -> None:
    """A small image from ``dockerfile`` (given on stdin, no context)."""
    done = subprocess.run(
        [docker_cli(), "build", "-t", tag, "-"],
        input=dockerfile,
        capture_output=True,
        text=True,
        env={**os.environ, "DOCKER_BUILDKIT": "1"},
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"docker build of {tag} exited {done.returncode}: {done.stderr[-3000:]}")


def image_size(tag: str) -> int:
    """The image's size in bytes, as ``docker images`` counts it (every layer, uncompressed)."""
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())
