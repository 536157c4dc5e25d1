"""The programs ds-launch runs besides Python: ssh, pdsh, mpirun, srun, or the script itself with --no_python.

Each is looked up on PATH before anything starts, so a missing one ends ds-launch with a message that names
it, the option that needs it and what to do, instead of a ``FileNotFoundError`` traceback, and never after
some hosts have already started.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence

from .cli import LAUNCHER_ALIASES
from .runners import Command

# Shells report "command not found" with 127; ds-launch does the same, so scripts can tell it from a usage error.
EXIT_MISSING_PROGRAM = 127

# What to do when a program is missing, by program name, else by launcher (mpirun is Open MPI's or MPICH's).
_ADVICE: dict[str, str] = {
    "ssh": "install an OpenSSH client (e.g. 'apt-get install openssh-client') or add the directory holding ssh to PATH",
    "pdsh": "install pdsh or add its directory to PATH, or use --launcher ssh",
    "srun": "run ds-launch on a SLURM login or compute node where srun is on PATH, or use --launcher ssh or pdsh",
    "openmpi": "install Open MPI or add its bin directory to PATH (e.g. 'module load openmpi'), "
    "or use --launcher ssh or pdsh",
    "mpich": "install MPICH or add its bin directory to PATH (e.g. 'module load mpich'), or use --launcher ssh or pdsh",
}
# Programs a launcher's command runs in turn: pdsh's ssh module (PDSH_RCMD_TYPE=ssh) runs ssh for every host.
_ALSO_NEEDS: dict[str, tuple[str, ...]] = {"pdsh": ("ssh",)}


class MissingProgramError(Exception):
    """A program the launch needs cannot be found or run; raised before any rank starts."""


def _option(launcher: str) -> str:
    aliases = [alias for alias, name in LAUNCHER_ALIASES.items() if name == launcher]
    return f"--launcher {launcher}" + "".join(f" (or {alias})" for alias in aliases)


def find(program: str, environ: Mapping[str, str]) -> str | None:
    """Where ``program`` resolves with this environment's PATH, as ``subprocess.Popen(env=environ)`` resolves
    it (a name with a '/' is taken as a path); None when missing or not executable."""
    return shutil.which(program, path=environ.get("PATH", os.defpath))


def require_launcher_programs(launcher: str, commands: Sequence[Command], environ: Mapping[str, str]) -> None:
    """Raise MissingProgramError naming the first program of ``commands`` that is not found (nothing is started)."""
    for cmd in commands:
        for program in (cmd.argv[0], *_ALSO_NEEDS.get(launcher, ())):
            if find(program, {**environ, **cmd.env}) is not None:
                continue
            advice = _ADVICE.get(program) or _ADVICE.get(launcher, f"install {program} or add its directory to PATH")
            raise MissingProgramError(
                f"{_option(launcher)} runs the program {program!r}, which is not on PATH here: {advice}; "
                "to run on this machine only, use --launcher torchrun"
            )


def require_script_program(user_script: str, environ: Mapping[str, str]) -> None:
    """With --no_python the workers exec the script itself: it must be an executable file or a command on PATH."""
    if find(user_script, environ) is not None:
        return
    executable = os.access(user_script, os.X_OK)
    if os.path.isfile(user_script) and os.sep not in user_script:
        # exec looks a bare name up on PATH only, never in the working directory.
        why = "a name without '/' is looked up on PATH, where it is not"
        fix = f"give its path as ./{user_script}" + ("" if executable else f" and run 'chmod +x {user_script}'")
    elif os.path.isfile(user_script):
        why = "the file is not executable"
        fix = f"run 'chmod +x {user_script}' (and start it with a '#!' line)"
    else:
        why = "it is neither an executable file nor a command on PATH"
        fix = "give the program's path or its name on PATH"
    raise MissingProgramError(
        f"--no_python runs {user_script!r} as a program, but {why}: {fix}, or drop --no_python to run it with Python"
    )
