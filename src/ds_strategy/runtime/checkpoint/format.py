"""The on-disk format: file names, the safe-value rule, atomic writes and reads that name the file at fault.

A checkpoint is one directory per tag under the save directory (docs/checkpointing.md has the full map):

    SAVE_DIR/latest                                   text: the newest complete tag
    SAVE_DIR/<tag>/meta.pt                            rank 0, written last: layouts, counters, client state,
                                                      scheduler, loss scaler, and the size of every file
    SAVE_DIR/<tag>/model_states.pt                    rank 0: module entries outside the flat partition
                                                      (buffers, frozen parameters)
    SAVE_DIR/<tag>/zero_rank_<r>_optim_states.pt      rank r: its partition of fp32 weights + optimizer
                                                      state, per param group, and its RNG states

[Note: safe files]
Every file holds tensors, plain containers (dict, list, tuple), numbers, strings, booleans and None
only, so ``torch.load(weights_only=True)`` reads it and a checkpoint from elsewhere cannot run code.
``check_safe`` enforces this at save time and names the key path of an offending value (a client state
holding a custom object fails before anything is written).

[Note: atomic writes]
A file is written to ``.<name>.tmp-<pid>`` in its final directory, flushed, fsynced and renamed; the
directory is fsynced after the rename. A reader therefore sees either no file or a complete one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ds_strategy import env

FORMAT = "ds_strategy.zero_checkpoint"
VERSION = 1
LATEST = "latest"
META = "meta.pt"
MODEL = "model_states.pt"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or key and what was expected."""


def ranks(count: int) -> str:
    """``1 rank``, ``2 ranks``: a world size as messages write it."""
    return f"{count} rank" if count == 1 else f"{count} ranks"


def rank_file(rank: int) -> str:
    return f"zero_rank_{rank:05d}_optim_states.pt"


# ------------------------------------------------------------------------------------------ safe values
# exact types: subclasses (torch's TorchVersion is a str, IntEnum an int) are pickled as their class
_SCALARS = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)


def check_safe(value: Any, where: str) -> None:
    """Raise ``CheckpointError`` naming the key path of the first value ``weights_only`` loading refuses."""
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(f"{where} is a {type(value).__name__}; save a plain torch.Tensor instead")
        return
    if type(value) in _SCALARS:
        return
    if type(value) in (list, tuple, torch.Size):
        for i, item in enumerate(value):
            check_safe(item, f"{where}[{i}]")
        return
    if type(value) is dict:
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)):
                raise CheckpointError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            check_safe(item, f"{where}[{key!r}]")
        return
    hint = " (convert it with dict(...))" if isinstance(value, Mapping) else ""
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold only tensors, "
        f"dict/list/tuple, numbers, strings and None, so that they load with torch.load(weights_only=True){hint}"
    )


def to_plain(value: Any) -> Any:
    """``value`` with container subclasses turned into their plain base (an ``AttributeDict`` or
    ``OrderedDict`` into ``dict``, a namedtuple into ``tuple``), so that ``check_safe`` accepts it: for
    callers such as the Lightning strategy whose checkpoint dicts hold such containers."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [to_plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


# ------------------------------------------------------------------------------------------ atomic writes
def pause_for_tests(name: str) -> None:
    """Test-only hook: ``DS_STRATEGY_CKPT_TEST_PAUSE=<seconds>`` announces each file on stderr and sleeps
    before writing it, so a test can SIGKILL a process in the middle of a save. Never set it otherwise."""
    delay = env.get(env.CKPT_TEST_PAUSE)
    if delay:
        import sys
        import time

        print(f"ds_strategy-ckpt-test: writing {name}", file=sys.stderr, flush=True)
        time.sleep(float(delay))


def fsync_dir(path: Path) -> None:
    """Persist a directory entry (a rename) on filesystems that support it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, mode: str, write: Callable[[Any], object]) -> None:
    """``write(file)`` on a temporary name opened with ``mode``, fsync, rename over ``path``: a reader sees
    the old file or the whole new one, never a torn one."""
    pause_for_tests(path.name)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def atomic_save(obj: Any, path: Path) -> int:
    """``torch.save`` to a temporary name, fsync, rename over ``path``; returns the file size in bytes."""
    _atomic_write(path, "wb", lambda f: torch.save(obj, f))
    return path.stat().st_size


def atomic_write_text(text: str, path: Path) -> None:
    _atomic_write(path, "w", lambda f: f.write(text))


# ------------------------------------------------------------------------------------------ reads
def read(path: Path, *, expected_size: int | None = None, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` on CPU; a missing, truncated or unreadable file is a CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes, the checkpoint's meta.pt recorded {expected_size}: "
            "it is truncated or was replaced"
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":  # torch.save writes a zip archive
        raise CheckpointError(f"checkpoint file {path} is damaged: it is not a torch.save archive (no zip header)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises RuntimeError/UnpicklingError/EOFError for damaged files
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(exc).__name__}: {exc})") from exc


def expect_format(data: Any, path: Path) -> dict[str, Any]:
    """The ``format``/``version`` header every file carries."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a ds_strategy checkpoint file (no format header {FORMAT!r})")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {data.get('version')}; this ds_strategy reads {VERSION}")
    return data
