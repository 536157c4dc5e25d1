"""SLURM's compressed host lists and task counts (``node[01-03,7],gpu-a`` / ``2(x3),1``), without scontrol."""

from __future__ import annotations

import re

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {text!r}: unbalanced ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def expand_nodelist(text: str) -> list[str]:
    """``node[01-03,7],gpu-a`` -> ``['node01', 'node02', 'node03', 'node7', 'gpu-a']`` (zero padding kept)."""
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for rng in ranges.split(","):
            m = _RANGE_RE.match(rng)
            if m is None:
                raise ValueError(f"SLURM node list {text!r}: {rng!r} is not N or N-M")
            lo, hi = m.group(1), m.group(2) or m.group(1)
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                for tail in expand_nodelist(suffix) if "[" in suffix else [suffix]:
                    hosts.append(f"{prefix}{n:0{width}d}{tail}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` as one count per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r}: {part!r} is not N or N(xM)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
