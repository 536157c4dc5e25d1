"""Which environment variables travel to the workers.

Local workers inherit the launcher's environment. Remote ones (ssh, pdsh, mpirun, srun) get, explicitly:
variables whose names start with one of ``EXPORT_PREFIXES`` (NCCL tuning such as NCCL_P2P_DISABLE /
NCCL_IB_DISABLE, PYTHONPATH, ...), then those of an env file (``KEY=VALUE`` lines, DeepSpeed's
``.deepspeed_env``), then ``--env KEY=VALUE`` / ``--env KEY`` from the command line; later ones win.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "FI_", "MV2_", "TORCH_", "DS_STRATEGY_", "OMP_NUM_THREADS")
ENV_FILE_NAME = ".deepspeed_env"
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvError(ValueError):
    """A malformed env file line or ``--env`` entry."""


def find_env_file(environ: Mapping[str, str], cwd: Path) -> Path | None:
    """``$DS_ENV_FILE`` if set, else ``./.deepspeed_env``, else ``~/.deepspeed_env`` (as DeepSpeed looks)."""
    explicit = environ.get("DS_ENV_FILE")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise EnvError(f"DS_ENV_FILE={explicit!r} does not name a file")
        return path
    for candidate in (cwd / ENV_FILE_NAME, Path.home() / ENV_FILE_NAME):
        if candidate.is_file():
            return candidate
    return None


def parse_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _NAME_RE.match(key):
            raise EnvError(f"{path}:{lineno}: expected 'NAME=VALUE', got {raw.strip()!r}")
        out[key] = value.strip()
    return out


def parse_env_flags(entries: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """``--env KEY=VALUE`` sets a value; ``--env KEY`` forwards the launcher's own value of KEY."""
    out: dict[str, str] = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        if not _NAME_RE.match(key):
            raise EnvError(f"--env {entry!r}: {key!r} is not a variable name (expected KEY=VALUE or KEY)")
        if not sep:
            if key not in environ:
                raise EnvError(f"--env {key}: the variable is not set here, so there is nothing to forward")
            value = environ[key]
        out[key] = value
    return out


def user_variables(entries: Sequence[str], environ: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """Variables the user asked for by name: the env file's, then ``--env``'s."""
    env_file = find_env_file(environ, cwd)
    out = parse_env_file(env_file) if env_file is not None else {}
    out.update(parse_env_flags(entries, environ))
    return out


def exported_variables(user_vars: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Everything a remote command must set: prefix-matched variables of this process, then ``user_vars``."""
    environ = os.environ if environ is None else environ
    out = {k: v for k, v in sorted(environ.items()) if k.startswith(EXPORT_PREFIXES)}
    out.update(user_vars)
    return out
