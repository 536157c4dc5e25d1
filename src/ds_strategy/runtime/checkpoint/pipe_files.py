"""Reading pipeline checkpoints without an engine: the file names, finding a tag, the saved pieces of each
parameter, and the consolidated state dict (``pipe_state_dict``, also behind ``ds-zero-to-fp32``). See
runtime/pipe/checkpoint.py for the layout and how a save is published. It lives here, beside the main
format's readers, so that consolidation (consolidate.py) reads both without importing the pipeline engine.

Every file is read with ``torch.load(weights_only=True)`` (``format.read``: a checkpoint cannot
run code on load), memory-mapped, and checked against the size ``pipe_meta.pt`` recorded for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .format import LATEST, CheckpointError, read
from .store import replaced_dir

PIPE_META = "pipe_meta.pt"
FORMAT = "ds_strategy.pipe_checkpoint"
VERSION = 2
FORMAT_1 = "ds_strategy-pipe-1"  # whole-value layer files, one per layer (read, never written)


def layer_key(idx: int) -> str:
    return f"layer_{idx:02d}"


def tied_key(key: str) -> str:
    return f"tied_{key}"


def rank_file(rank: int) -> str:
    return f"pipe_rank_{rank:05d}_states.pt"


def _format1_file(key: str) -> str:
    return f"{key}-model_states.pt"


def resolve_pipe(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The tag directory to load: ``latest``'s tag by default; the old copy of a tag whose re-save was
    killed between its two renames ([Note: publishing a tag] in checkpoint/store.py)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"{root} has no {LATEST!r} file; pass tag=")
        tag = latest.read_text().strip()
    tag_dir = root / str(tag)
    if not tag_dir.is_dir() and (replaced_dir(root, str(tag)) / PIPE_META).is_file():
        return replaced_dir(root, str(tag))
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


class PipeCheckpoint:
    """One saved tag: its metadata and, per entry (``layer_03``, ``tied_embed``), the saved pieces of each
    parameter (``start``: offset in the flattened parameter; the data-parallel ranks' pieces tile it), its
    optimizer state pieces, and its whole module entries (frozen parameters, buffers)."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = tag_dir
        path = tag_dir / PIPE_META
        meta = read(path)
        if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, FORMAT_1):
            raise CheckpointError(f"{path} is not a ds_strategy pipeline checkpoint (no format header {FORMAT!r})")
        if meta["format"] == FORMAT and meta.get("version") != VERSION:
            raise CheckpointError(f"{path} has format version {meta.get('version')}; this ds_strategy reads {VERSION}")
        self.meta: dict[str, Any] = meta
        self.format1 = meta["format"] == FORMAT_1
        for name, size in meta.get("files", {}).items():
            file = tag_dir / name
            if not file.is_file():
                raise CheckpointError(
                    f"checkpoint file {file} is missing (the checkpoint was written by {meta['world_size']} ranks; "
                    "when several nodes saved to local disks, copy every node's files into this directory)"
                )
            if file.stat().st_size != size:
                raise CheckpointError(
                    f"checkpoint file {file} has {file.stat().st_size} bytes, {PIPE_META} recorded {size}: it is "
                    "truncated or was replaced"
                )
        self._checked: set[tuple[str, str]] = set()
        self._files: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ entries
    def entries(self) -> list[str]:
        if self.format1:
            return sorted(p.name.removesuffix("-model_states.pt") for p in self.tag_dir.glob("*-model_states.pt"))
        return sorted(self.meta["entries"])

    def has(self, key: str) -> bool:
        return key in self.entries()

    def prefix(self, key: str) -> str:
        return str(self._pieces(key)[0][1]["prefix"])

    def _file(self, name: str) -> dict[str, Any]:
        """A file of the tag, read once per reader (memory-mapped: only the pages copied out are read)."""
        if name not in self._files:
            self._files[name] = self._read(name)
        return self._files[name]

    def _read(self, name: str) -> dict[str, Any]:
        path = self.tag_dir / name
        data = read(path, expected_size=self.meta.get("files", {}).get(name), mmap=True)
        if self.format1:
            return _from_format1(data, path)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("save_id") != self.meta["save_id"]:
            raise CheckpointError(
                f"{path} was not written by the save that wrote {self.tag_dir / PIPE_META} (files of different "
                "checkpoints mixed?)"
            )
        return data

    def rank_data(self, rank: int) -> dict[str, Any]:
        """A saved rank's file (format 2): its entries' pieces, RNG state and header."""
        return self._file(rank_file(rank))

    def _pieces(self, key: str) -> list[tuple[Path, dict[str, Any]]]:
        """(file, saved entry) of every file holding a piece of entry ``key``."""
        if self.format1:
            name = _format1_file(key)
            return [(self.tag_dir / name, self._file(name))]
        entry = self.meta["entries"].get(key)
        if entry is None:
            raise CheckpointError(f"{self.tag_dir} holds no entry {key!r} (it holds {self.entries()})")
        return [(self.tag_dir / rank_file(r), self._file(rank_file(r))["entries"][key]) for r in entry["ranks"]]

    def module_entries(self, key: str) -> dict[str, torch.Tensor]:
        """The whole values of ``key``'s frozen parameters and buffers."""
        out: dict[str, torch.Tensor] = {}
        for _, saved in self._pieces(key):
            out.update(saved["module"])
        return out

    def params(self, key: str) -> dict[str, list[int]]:
        """Shape of every trainable parameter of ``key`` (as saved)."""
        out: dict[str, list[int]] = {}
        for _, saved in self._pieces(key):
            for name, piece in saved["params"].items():
                out.setdefault(name, list(piece["shape"]))
        return out

    def state_keys(self, key: str, name: str) -> list[str]:
        for _, saved in self._pieces(key):
            piece = saved["params"].get(name)
            if piece is not None:
                return sorted(piece["state"])
        return []

    # ------------------------------------------------------------------ values
    def _parts(self, key: str, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
        pieces = [(path, saved["params"][name]) for path, saved in self._pieces(key) if name in saved["params"]]
        if (key, name) not in self._checked:
            self._check_tiling(key, name, pieces)
            self._checked.add((key, name))
        for _, piece in pieces:
            yield int(piece["start"]), piece

    def _check_tiling(self, key: str, name: str, pieces: list[tuple[Path, dict[str, Any]]]) -> None:
        """The pieces cover the flattened parameter exactly once, with one shape and the same state keys."""
        numel = 1
        shape = list(pieces[0][1]["shape"]) if pieces else []
        for d in shape:
            numel *= int(d)
        at = 0
        for path, piece in sorted(pieces, key=lambda x: int(x[1]["start"])):
            n = piece["fp32"].numel()
            if n == 0 and list(piece["shape"]) == shape:  # a rank whose shard misses this parameter
                continue
            bad = (
                list(piece["shape"]) != shape
                or int(piece["start"]) != at
                or any(v.numel() != n for v in piece["state"].values())
                or sorted(piece["state"]) != sorted(pieces[0][1]["state"])
            )
            if bad:
                raise CheckpointError(
                    f"{path}: the piece of {key}/{name} at [{piece['start']}, {int(piece['start']) + n}) (shape "
                    f"{list(piece['shape'])}, state {sorted(piece['state'])}) does not continue the pieces before it "
                    f"at {at} (shape {shape}); files of different checkpoints mixed?"
                )
            at += n
        if at != numel:
            raise CheckpointError(
                f"{self.tag_dir}: the saved pieces of {key}/{name} cover {at} of its {numel} elements (a rank's "
                "file is missing or comes from another checkpoint)"
            )

    def read_range(self, key: str, name: str, kind: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (1-D) with elements ``[start, start + out.numel())`` of the flattened ``kind``
        (``"fp32"`` or an optimizer state key) of parameter ``name`` of ``key``; returns ``out``."""
        end = start + out.numel()
        for at, piece in self._parts(key, name):
            value = piece["fp32"] if kind == "fp32" else piece["state"][kind]
            a, z = max(start, at), min(end, at + value.numel())
            if a < z:
                out[a - start : z - start].copy_(value[a - at : z - at])
        return out

    def full(self, key: str, name: str, kind: str = "fp32") -> torch.Tensor:
        shape = self.params(key)[name]
        numel = 1
        for d in shape:
            numel *= int(d)
        dtype = torch.float32
        if kind != "fp32":
            for _, piece in self._parts(key, name):
                dtype = piece["state"][kind].dtype
                break
        return self.read_range(key, name, kind, 0, torch.empty(numel, dtype=dtype)).view(shape)


def _from_format1(data: Any, path: Path) -> dict[str, Any]:
    """A format-1 layer file (whole values) as one format-2 entry: every trainable parameter one piece."""
    if not isinstance(data, dict) or not {"module", "optimizer", "prefix"} <= set(data):
        raise CheckpointError(f"{path} is not a pipeline layer file (no module/optimizer/prefix entries)")
    trainable = data["optimizer"]
    return {
        "prefix": data["prefix"],
        "params": {
            name: {
                "shape": list(data["module"][name].shape),
                "start": 0,
                "fp32": data["module"][name].reshape(-1),
                "state": {k: v.reshape(-1) for k, v in states.items()},
            }
            for name, states in trainable.items()
        },
        "module": {k: v for k, v in data["module"].items() if k not in trainable},
    }


def pipe_state_dict(load_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, torch.Tensor]:
    """The fp32 weights of a pipeline checkpoint as one state dict with a one-stage PipelineModule's names."""
    source = PipeCheckpoint(resolve_pipe(load_dir, tag))
    out: dict[str, torch.Tensor] = {}
    for key in source.entries():
        prefix = source.prefix(key)
        for name in source.params(key):
            out[prefix + name] = source.full(key, name)
        for name, value in source.module_entries(key).items():
            out[prefix + name] = value.clone()
    return out
