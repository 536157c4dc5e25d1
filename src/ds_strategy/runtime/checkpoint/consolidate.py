"""Consolidation: a checkpoint's fp32 weights as one plain state dict, for the bare ``nn.Module`` or for
``LightningModule.load_from_checkpoint``; the ``ds-zero-to-fp32`` console script.

    ds-zero-to-fp32 CHECKPOINT_DIR OUTPUT [--tag TAG] [--lightning] [--prefix model.]

Parameters are assembled one at a time from the ranks' memory-mapped partition files, so peak memory is
the fp32 model being written plus one parameter; the optimizer state in the same files is never read.
Shards written by several nodes need only be copied into one tag directory (files are named by global
rank; ``meta.pt`` lists them all and a missing one is named in the error).

Entries outside the flat partition (buffers, frozen parameters below stage 3) come from ``model_states.pt``,
stage 3's frozen parameters from their partitions (an adapters-only checkpoint has none: they are left out);
floating ones are cast to fp32 (the engine keeps them in the compute dtype). Tied parameters appear under
every name the module's ``state_dict`` gives them, as one shared tensor.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..layout import FlatLayout
from .experts import expert_state, layer_of_key
from .format import MODEL, CheckpointError, atomic_save, expect_format, read
from .frozen import FrozenSource
from .pipe_files import is_pipe_checkpoint, pipe_state_dict
from .reshard import full_param, index_by_name
from .store import rank_reader, read_meta, resolve


def _open(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> tuple[Path, dict[str, Any], list[FlatLayout]]:
    tag_dir = resolve(checkpoint_dir, tag)
    meta = read_meta(tag_dir)
    return tag_dir, meta, [FlatLayout.from_dict(g["layout"]) for g in meta["groups"]]


def iter_fp32_state(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(state-dict key, fp32 tensor)`` in the module's ``state_dict`` order, one at a time."""
    tag_dir, meta, layouts = _open(checkpoint_dir, tag)
    model_path = tag_dir / MODEL
    model = expect_format(read(model_path, expected_size=meta["files"].get(MODEL), mmap=True), model_path)
    rank_data = rank_reader(tag_dir, meta, layouts)
    where = index_by_name(layouts)
    frozen = FrozenSource(meta, rank_data, {})  # stage 3's frozen partitions
    aliases: dict[str, str] = meta.get("aliases", {})
    shared = set(aliases.values())
    kept: dict[str, torch.Tensor] = {}
    moe_layers: list[dict[str, Any]] = meta.get("moe_layers", [])
    done: set[int] = set()
    for key in meta["state_keys"]:
        layer = layer_of_key(key, moe_layers)
        if layer is not None:  # rank 0's local experts stand for every expert of the layer ([Note: expert files])
            if layer["layer"] not in done:
                done.add(layer["layer"])
                yield from expert_state(tag_dir, meta, layer)
            continue
        name = aliases.get(key, key)
        if name in kept:
            yield key, kept[name]
            continue
        if name in where:
            src = where[name]
            value = full_param(layouts[src.group], src.index, _kind(rank_data, src.group, "fp32"))
        elif frozen.shape(name) is not None:
            value = frozen.full(name).float()
        elif name in frozen.excluded:
            continue  # an adapters-only checkpoint (exclude_frozen_parameters): the base is not in it
        elif key in model["module"]:
            saved = model["module"][key]
            value = saved.float() if saved.is_floating_point() else saved.clone()
        else:
            raise CheckpointError(f"{tag_dir}: state-dict key {key!r} is neither in the partitions nor in {MODEL}")
        if name in shared:
            kept[name] = value
        yield key, value


def consolidate_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a plain fp32 state dict (``module.load_state_dict`` takes it); a
    pipeline checkpoint's per-rank files merge into the names of a one-stage PipelineModule."""
    if is_pipe_checkpoint(checkpoint_dir, tag):
        return pipe_state_dict(checkpoint_dir, tag)
    return dict(iter_fp32_state(checkpoint_dir, tag))


def consolidate_optimizer_state(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> dict[str, dict[str, Any]]:
    """Per trainable parameter, its optimizer state reassembled (``{"exp_avg": tensor, "step": 3.0, ...}``)."""
    tag_dir, meta, layouts = _open(checkpoint_dir, tag)
    rank_data = rank_reader(tag_dir, meta, layouts)
    out: dict[str, dict[str, Any]] = {}
    for g, layout in enumerate(layouts):
        saved = rank_data(0)["groups"][g]
        for i, slot in enumerate(layout.params):
            state: dict[str, Any] = {k: v["value"] for k, v in saved["scalars"].items()}
            for key in saved["state"]:
                state[key] = full_param(layout, i, _kind(rank_data, g, key))
            out[slot.name] = state
    return out


def _kind(rank_data: Callable[[int], dict[str, Any]], group: int, key: str) -> Callable[[int], torch.Tensor]:
    """``rank -> flat partition`` of one saved group: its fp32 weights or one optimizer state key."""

    def get(rank: int) -> torch.Tensor:
        saved = rank_data(rank)["groups"][group]
        return saved["fp32"] if key == "fp32" else saved["state"][key]

    return get


def lightning_checkpoint(
    state_dict: dict[str, torch.Tensor], meta: dict[str, Any], *, prefix: str = ""
) -> dict[str, Any]:
    """What ``LightningModule.load_from_checkpoint`` reads: ``state_dict``, ``pytorch-lightning_version``, and
    ``hyper_parameters`` when the client state carried them (the Lightning strategy saves them there)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pl_version = version("lightning")
    except PackageNotFoundError:
        pl_version = "2.0.0"
    client = meta.get("client_state") or {}
    out: dict[str, Any] = {
        "state_dict": {prefix + k: v for k, v in state_dict.items()},
        "pytorch-lightning_version": pl_version,
        "epoch": int(client.get("epoch", 0)) if isinstance(client.get("epoch", 0), int) else 0,
        "global_step": int(meta["counters"]["global_steps"]),
    }
    if isinstance(client.get("hyper_parameters"), dict):
        out["hyper_parameters"] = client["hyper_parameters"]
    return out


def write_fp32(
    checkpoint_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    tag: str | None = None,
    lightning: bool = False,
    prefix: str = "",
) -> Path:
    """Write the consolidated fp32 weights to ``output``: a ``.safetensors`` file (needs the safetensors
    package), a Lightning checkpoint (``lightning=True``), or else a ``torch.save`` file. An existing
    directory as ``output`` receives ``model.safetensors`` / ``model.ckpt`` / ``pytorch_model.bin``."""
    out = Path(output)
    if out.is_dir():
        out = out / ("model.ckpt" if lightning else "pytorch_model.bin")
    state = consolidate_fp32_state_dict(checkpoint_dir, tag)
    if out.suffix == ".safetensors":
        if lightning:
            raise ValueError("a Lightning checkpoint is a torch file; choose an output name not ending in .safetensors")
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise CheckpointError(
                f"writing {out} needs the safetensors package (pip install safetensors); or pick a .pt/.bin name"
            ) from exc
        # safetensors refuses shared storage: tied parameters are written as separate copies
        seen: set[int] = set()
        plain = {}
        for k, v in state.items():
            plain[prefix + k] = v.clone() if id(v) in seen else v.contiguous()
            seen.add(id(v))
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(plain, str(out), metadata={"format": "pt"})
        return out

    if is_pipe_checkpoint(checkpoint_dir, tag):
        if lightning:
            raise CheckpointError("a pipeline checkpoint has no Lightning form (pipelines train through initialize())")
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_save({prefix + k: v for k, v in state.items()}, out)
        return out
    _, meta, _ = _open(checkpoint_dir, tag)
    payload: dict[str, Any] = (
        lightning_checkpoint(state, meta, prefix=prefix) if lightning else {prefix + k: v for k, v in state.items()}
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(payload, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-zero-to-fp32",
        description="Consolidate a ds_strategy ZeRO checkpoint (any stage, any number of ranks or nodes) into one "
        "fp32 state dict.",
    )
    parser.add_argument("checkpoint_dir", help="the directory passed to save_checkpoint (holds 'latest' and tags)")
    parser.add_argument("output", help="output file (.pt/.bin, .safetensors) or an existing directory")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named by 'latest')")
    parser.add_argument(
        "--lightning", action="store_true", help="write a checkpoint for LightningModule.load_from_checkpoint"
    )
    parser.add_argument("--prefix", default="", help="prepended to every key (e.g. 'model.' for a LightningModule)")
    parser.add_argument(
        "--safetensors",
        action="store_true",
        help="write Hugging Face's sharded layout into the output directory (model*.safetensors + "
        "model.safetensors.index.json), which from_pretrained loads; streamed one shard at a time",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="with --safetensors: the largest shard (default 5GB)")
    args = parser.parse_args(argv)
    try:
        if args.safetensors:
            if args.lightning:
                parser.error("--safetensors and --lightning exclude each other")
            from .hf import write_hf_fp32

            _, meta, _ = _open(args.checkpoint_dir, args.tag)
            pairs = iter_fp32_state(args.checkpoint_dir, args.tag)
            written = write_hf_fp32(pairs, args.output, args.max_shard_size, args.prefix, meta.get("aliases", {}))
            out = Path(args.output)
            print(f"wrote {len(written)} safetensors file(s) to {out}")
            return 0
        out = write_fp32(args.checkpoint_dir, args.output, tag=args.tag, lightning=args.lightning, prefix=args.prefix)
    except CheckpointError as exc:
        print(f"ds-zero-to-fp32: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
