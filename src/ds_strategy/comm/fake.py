"""Whether a process group is torch's fake one (``torch.testing._internal.distributed.fake_pg``): one process
that stands for a rank of N, its collectives moving no data (see [Note: the fake process group] in
distributed.py). Below the rest of comm/: every module asks it, none is imported by it.
"""

from __future__ import annotations

import torch.distributed as dist

FAKE_BACKEND = "fake"  # torch's fake process group (torch.testing._internal.distributed.fake_pg)


def is_fake_backend(backend: str) -> bool:
    """Whether ``backend`` (a name as ``dist.get_backend`` gives it, ``"fake"`` or a device map such as
    ``"cpu:fake,cuda:fake"``) is torch's fake process group (see [Note: the fake process group])."""
    return any(item.split(":", 1)[-1].strip().lower() == FAKE_BACKEND for item in str(backend).split(","))


def is_fake_group(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (None: the default group) is a fake process group: one process, no peers behind it."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):  # not a member of ``group``, or no default group after all
        return False
    return is_fake_backend(str(backend))
