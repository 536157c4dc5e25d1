"""Reading pipeline checkpoints without an engine: the file names, finding a tag, and the consolidated
state dict (``pipe_state_dict``, also behind ``ds-zero-to-fp32``). See checkpoint.py for the layout."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint.format import LATEST, CheckpointError

PIPE_META = "pipe_meta.pt"
FORMAT = "ds_strategy-pipe-1"


def layer_file(idx: int) -> str:
    return f"layer_{idx:02d}-model_states.pt"


def tied_file(key: str) -> str:
    return f"tied_{key}-model_states.pt"


def resolve_pipe(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"{root} has no {LATEST!r} file; pass tag=")
        tag = latest.read_text().strip()
    tag_dir = root / str(tag)
    if not (tag_dir / PIPE_META).is_file():
        raise CheckpointError(
            f"{tag_dir} is not a pipeline checkpoint (no {PIPE_META}); a ZeroEngine checkpoint loads with "
            "ZeroEngine.load_checkpoint"
        )
    return tag_dir


def is_pipe_checkpoint(load_dir: str | os.PathLike[str], tag: str | None) -> bool:
    try:
        resolve_pipe(load_dir, tag)
    except CheckpointError:
        return False
    return True


def pipe_state_dict(load_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, torch.Tensor]:
    """The fp32 weights of a pipeline checkpoint as one state dict with a one-stage PipelineModule's names."""
    tag_dir = resolve_pipe(load_dir, tag)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(tag_dir.glob("*-model_states.pt")):
        saved = torch.load(path, weights_only=False)
        for name, value in saved["module"].items():
            out[saved["prefix"] + name] = value
    return out
