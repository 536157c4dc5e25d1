"""``ds-launch``: start a training script on this machine (torch's elastic agent, as torchrun) or on several
(ssh, pdsh, mpirun, srun), with DeepSpeed's launcher flags. See docs/launching.md."""

from __future__ import annotations

from .cli import LaunchArgs, build_parser, parse_args
from .hostfile import HostfileError, Node, WorldPlan, parse_filter, parse_hostfile, parse_hostfile_text, resolve_plan
from .launch import decide, main, run

__all__ = [
    "HostfileError",
    "LaunchArgs",
    "Node",
    "WorldPlan",
    "build_parser",
    "decide",
    "main",
    "parse_args",
    "parse_filter",
    "parse_hostfile",
    "parse_hostfile_text",
    "resolve_plan",
    "run",
]
