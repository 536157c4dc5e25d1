"""Hostfiles and ``--include`` / ``--exclude`` filters, resolved into a ``WorldPlan``.

A hostfile lists the machines of a job and how many ranks each runs (the OpenMPI / DeepSpeed form)::

    # comments and blank lines are ignored
    worker-1 slots=4
    worker-2 slots=4

A filter names hosts and, optionally, slot (device) indices on them, joined by ``@``:
``worker-1:0,1@worker-2`` keeps (``--include``) or drops (``--exclude``) slots 0 and 1 of worker-1 and
all of worker-2. Every error names the file and line, or the filter token, at fault.
"""

from __future__ import annotations

import base64
import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")
_SLOTS_RE = re.compile(r"^slots=(\S+)$")


class HostfileError(ValueError):
    """A malformed hostfile or filter, or a request the resources cannot satisfy."""


@dataclass(frozen=True)
class Node:
    """One machine of the job and the slot (device) indices it runs ranks on, in local-rank order."""

    host: str
    slots: tuple[int, ...]

    @property
    def is_contiguous(self) -> bool:
        """True when the slots are ``0..n-1``: LOCAL_RANK then equals the device index without remapping."""
        return self.slots == tuple(range(len(self.slots)))


@dataclass(frozen=True)
class WorldPlan:
    """The machines of a job in node-rank order. Global ranks follow that order, then local rank."""

    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise HostfileError("the plan has no nodes left to run on")
        for node in self.nodes:
            if not node.slots:
                raise HostfileError(f"host {node.host!r} has no slots left to run on")

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(len(n.slots) for n in self.nodes)

    @property
    def hosts(self) -> list[str]:
        return [n.host for n in self.nodes]

    def uniform_procs(self) -> int | None:
        """The ranks per node when every node runs the same number, else None."""
        counts = {len(n.slots) for n in self.nodes}
        return counts.pop() if len(counts) == 1 else None

    def is_local(self) -> bool:
        """A single node that is this machine: launch directly, no ssh / MPI / SLURM needed."""
        return self.num_nodes == 1 and is_local_host(self.nodes[0].host)

    def encode(self) -> str:
        """A shell-safe string handed to every node's launcher (``--world_info``) so each finds its slots."""
        payload = json.dumps([[n.host, list(n.slots)] for n in self.nodes], separators=(",", ":"))
        return base64.urlsafe_b64encode(payload.encode()).decode()

    @classmethod
    def decode(cls, text: str) -> WorldPlan:
        try:
            raw = json.loads(base64.urlsafe_b64decode(text.encode()).decode())
            return cls(tuple(Node(str(host), tuple(int(s) for s in slots)) for host, slots in raw))
        except (ValueError, TypeError) as exc:
            raise HostfileError(f"--world_info is not a plan written by ds-launch: {exc}") from exc


def is_local_host(host: str) -> bool:
    return host in LOCAL_HOSTS or host in {socket.gethostname(), socket.getfqdn()}


def parse_hostfile_text(text: str, *, source: str = "<hostfile>") -> dict[str, int]:
    """``host slots=N`` lines into an ordered ``{host: slots}``; errors name ``source:line``."""
    pool: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        fields = line.split()
        host = fields[0]
        if not _HOST_RE.match(host):
            raise HostfileError(f"{where}: {host!r} is not a host name (line: {raw.strip()!r})")
        slots = _SLOTS_RE.match(fields[1]) if len(fields) == 2 else None
        if slots is None:
            raise HostfileError(
                f"{where}: expected 'HOST slots=N', got {raw.strip()!r} (every host needs its slot count)"
            )
        value = slots.group(1)
        if not value.isdigit() or int(value) < 1:
            raise HostfileError(f"{where}: slots must be a positive integer, got {value!r} for host {host!r}")
        if host in pool:
            raise HostfileError(f"{where}: host {host!r} is listed twice (merge the lines into one slot count)")
        pool[host] = int(value)
    if not pool:
        raise HostfileError(f"{source}: no hosts listed (expected lines like 'worker-1 slots=4')")
    return pool


def parse_hostfile(path: str | Path) -> dict[str, int]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise HostfileError(f"cannot read hostfile {str(path)!r}: {exc.strerror or exc}") from exc
    return parse_hostfile_text(text, source=str(path))


def parse_filter(spec: str, *, flag: str = "--include") -> dict[str, list[int] | None]:
    """``host:0,1@host2`` into ``{host: [slots] or None (all slots)}``; errors name the bad token."""
    out: dict[str, list[int] | None] = {}
    for token in spec.split("@"):
        token = token.strip()
        if not token:
            raise HostfileError(f"{flag} {spec!r}: empty entry (hosts are separated by a single '@')")
        host, sep, slot_text = token.partition(":")
        if not host or not _HOST_RE.match(host):
            raise HostfileError(f"{flag} {spec!r}: {token!r} does not start with a host name")
        if not sep:
            out[host] = None
            continue
        slots: list[int] = []
        for item in slot_text.split(","):
            if not item.strip().isdigit():
                raise HostfileError(
                    f"{flag} {spec!r}: in {token!r}, {item!r} is not a slot index (expected HOST:0,1,...)"
                )
            slots.append(int(item))
        previous = out.get(host, [])
        out[host] = None if host in out and previous is None else sorted(set((previous or []) + slots))
    return out


def _check_known(filt: dict[str, list[int] | None], pool: dict[str, int], flag: str) -> None:
    for host, slots in filt.items():
        if host not in pool:
            raise HostfileError(f"{flag}: host {host!r} is not in the resource pool (known: {', '.join(pool)})")
        for s in slots or []:
            if s >= pool[host]:
                raise HostfileError(
                    f"{flag}: slot {s} of host {host!r} does not exist (it has {pool[host]} slots: 0..{pool[host] - 1})"
                )


def resolve_plan(
    pool: dict[str, int],
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_procs: int = -1,
) -> WorldPlan:
    """Apply DeepSpeed's resource rules: include XOR exclude, then the first ``num_nodes`` hosts, then the
    first ``num_procs`` remaining slots of each host (-1 means all)."""
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together: pick one")
    slots: dict[str, list[int]] = {host: list(range(n)) for host, n in pool.items()}
    if include:
        filt = parse_filter(include, flag="--include")
        _check_known(filt, pool, "--include")
        # Hostfile order decides node ranks, whatever order the filter names the hosts in.
        kept: dict[str, list[int]] = {}
        for host, all_slots in slots.items():
            if host in filt:
                chosen = filt[host]
                kept[host] = all_slots if chosen is None else chosen
        slots = kept
    elif exclude:
        filt = parse_filter(exclude, flag="--exclude")
        _check_known(filt, pool, "--exclude")
        for host, dropped in filt.items():
            slots[host] = [] if dropped is None else [s for s in slots[host] if s not in dropped]
        slots = {h: s for h, s in slots.items() if s}
    if not slots:
        raise HostfileError(f"--exclude {exclude!r} leaves no hosts to run on")
    hosts = list(slots)
    if num_nodes > 0:
        if num_nodes > len(hosts):
            raise HostfileError(f"--num_nodes {num_nodes} asks for more hosts than available ({len(hosts)}: {hosts})")
        hosts = hosts[:num_nodes]
    nodes = []
    for host in hosts:
        chosen = slots[host]
        if num_procs > 0:
            if num_procs > len(chosen):
                raise HostfileError(
                    f"--num_procs {num_procs} asks for more slots than host {host!r} has available ({len(chosen)})"
                )
            chosen = chosen[:num_procs]
        nodes.append(Node(host, tuple(chosen)))
    return WorldPlan(tuple(nodes))
