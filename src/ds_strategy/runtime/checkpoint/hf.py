"""Hugging Face weights (safetensors, sharded with ``model.safetensors.index.json``) into and out of a model
at any stage, without the whole model on any rank: ``load_hf_weights`` / ``save_hf_weights``
(re-exported by ``ds_strategy.utils``) and the writer behind ``ds-zero-to-fp32 --safetensors``.

[Note: reading only this rank's slices]
A safetensors file is memory-mapped and a tensor's slice ``get_slice(key)[r0:r1]`` reads only those rows'
bytes. Each parameter is written where this rank keeps it, so each rank reads just that flat range of
the file's tensor (the rows covering it, at most one partial row more at each end):

- a trainable parameter of an engine (any stage): this rank's fragment of the fp32 masters (the access
  link of ``runtime/zero/access.py``); the stage then publishes the masters into the compute-dtype
  parameters (at stages 1-3 a collective, so every rank calls ``load_hf_weights``);
- a frozen stage-3 parameter: this rank's shard of the frozen partition (compute dtype);
- a ``zero.Init`` parameter (no engine yet): its zero.Init shard;
- anything else (a plain module, buffers, frozen parameters at stages 0-2): the whole tensor.

Saving streams the other way: parameters are assembled one at a time (a collective where partitioned),
rank 0 collects them into the current shard file and writes it once ``max_shard_size`` bytes are
gathered, so no rank holds more than one shard plus one parameter. The layout and index are Hugging
Face's own (``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``
with ``{"metadata": {"total_size": ...}, "weight_map": {key: file}}``), which ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..moe.full import ExpertNames
from ..packed import is_packed
from ..zero.access import _fragment, find
from ..zero.init import gather_init_param, init_shard
from ..zero.placement import ZERO3_ATTR
from .format import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise CheckpointError(
            "Hugging Face weights need the safetensors package: pip install safetensors "
            "(or pip install 'ds_strategy[hf]')"
        ) from exc
    return safetensors


def parse_size(size: int | str) -> int:
    """``max_shard_size`` as Hugging Face writes it: bytes, or ``"5GB"`` (10^9), ``"500MiB"`` (2^20) ..."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(str(size))
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: use a number of bytes or a size such as '5GB', '500MB', '2GiB'")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


# ---------------------------------------------------------------------------------------------- reading
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class _Files:
    """The tensors of a safetensors file or directory (sharded with an index), opened lazily.

    Read with plain ``pread`` calls, not through a memory map: pages of a mapped file that were read count in
    the process's resident set until it is unmapped, so reading half of a mapped base would add half the base
    to every rank's RSS; read into our own buffer, only the bytes this rank keeps are ever resident. The
    format is a little-endian u64 header length, a JSON header ``{key: {dtype, shape, data_offsets}}``, then
    the data, each tensor C-contiguous: a flat element range is one contiguous byte range."""

    def __init__(self, path: str | os.PathLike[str], stack: ExitStack) -> None:
        root = Path(path)
        self._stack = stack
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}
        self._fds: dict[Path, int] = {}
        if root.is_file():
            files = {root}
            self.where = self._keys_of(root)
        elif (root / INDEX).is_file():
            index = json.loads((root / INDEX).read_text(encoding="utf-8"))
            self.where = {k: root / f for k, f in index["weight_map"].items()}
            files = set(self.where.values())
        elif (root / SINGLE).is_file():
            self.where = self._keys_of(root / SINGLE)
            files = {root / SINGLE}
        else:
            raise CheckpointError(
                f"{root} holds no Hugging Face safetensors weights: expected {SINGLE}, or {INDEX} with its shards, "
                "or pass a .safetensors file"
            )
        missing = sorted(str(f) for f in files if not f.is_file())
        if missing:
            raise CheckpointError(f"{root}: {INDEX} names shard files that do not exist: {missing}")

    def _keys_of(self, file: Path) -> dict[str, Path]:
        return dict.fromkeys((k for k in self._header(file)[1] if k != "__metadata__"), file)

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            fd = os.open(file, os.O_RDONLY)
            self._stack.callback(os.close, fd)
            self._fds[file] = fd
        return self._fds[file]

    def _pread(self, file: Path, offset: int, size: int) -> bytearray:
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        while done < size:
            n = os.preadv(self._fd(file), [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{file} is truncated: {size - done} bytes missing at offset {offset + done}")
            done += n
        return buf

    def _header(self, file: Path) -> tuple[int, dict[str, Any]]:
        if file not in self._headers:
            try:
                (length,) = struct.unpack("<Q", self._pread(file, 0, 8))
                header = json.loads(self._pread(file, 8, length).decode("utf-8"))
            except (CheckpointError, ValueError, struct.error) as exc:
                raise CheckpointError(f"{file} is not a safetensors file ({exc})") from exc
            self._headers[file] = (8 + length, header)
        return self._headers[file]

    def _entry(self, key: str) -> tuple[Path, int, dict[str, Any]]:
        file = self.where[key]
        start, header = self._header(file)
        if key not in header:
            raise CheckpointError(f"{file} does not hold {key}, which {INDEX} places there")
        return file, start, header[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)[2]["shape"])

    def read_flat(self, key: str, a: int, z: int) -> torch.Tensor:
        """Elements ``[a, z)`` of the flattened tensor: only those bytes are read."""
        file, start, entry = self._entry(key)
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{file}: {key} has dtype {entry['dtype']}, which ds_strategy cannot read")
        item = torch.empty((), dtype=dtype).element_size()
        if z <= a:
            return torch.empty(0, dtype=dtype)
        begin = start + entry["data_offsets"][0] + a * item
        return torch.frombuffer(self._pread(file, begin, (z - a) * item), dtype=dtype)


def _targets(module: nn.Module, prefix: str, with_frozen: bool = True) -> dict[str, torch.Tensor]:
    """Module key -> parameter or persistent buffer (each tensor once, under its first name: a tied
    weight is saved once, as Hugging Face does), keys under ``prefix`` only, with the prefix removed."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if name.startswith(prefix) and id(p) not in seen and (with_frozen or p.requires_grad):
            out[name[len(prefix) :]] = p
        seen.add(id(p))
    if with_frozen:
        for mod_name, mod in module.named_modules():
            for buf_name, buf in mod._buffers.items():
                name = f"{mod_name}.{buf_name}" if mod_name else buf_name
                if buf is None or buf_name in mod._non_persistent_buffers_set or id(buf) in seen:
                    continue
                seen.add(id(buf))
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = buf
    return out


def _aliases(module: nn.Module, prefix: str) -> dict[str, str]:
    """Every other name of a shared parameter -> its first name (``lm_head.weight`` -> ``model.embed_tokens.weight``
    when the head is tied to the embedding)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        if id(p) in first:
            out[key] = first[id(p)]
        else:
            first[id(p)] = key
    return out


def _module_of(model: Any) -> nn.Module:
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and hasattr(model, "stage"):  # a ZeroEngine: its module's keys
        return inner
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module or a ZeroEngine, got {type(model).__name__}")
    return model


def _true_shape(t: torch.Tensor) -> tuple[int, ...]:
    z3 = getattr(t, ZERO3_ATTR, None)
    if z3 is not None:
        stage, g, i = z3
        return tuple(stage.storages[g].layout.params[i].shape)
    info = init_shard(t)
    return tuple(info.shape) if info is not None else tuple(t.shape)


@torch.no_grad()
def load_hf_weights(model: Any, path: str | os.PathLike[str], *, strict: bool = True, prefix: str = "") -> None:
    """Load Hugging Face safetensors weights (a ``model.safetensors`` file, a sharded directory with
    ``model.safetensors.index.json``, or one ``.safetensors`` file) into ``model``: a plain module, a module
    built under ``ds_strategy.zero.Init``, or a ZeroEngine / its module at any stage. Partitioned parameters
    read only this rank's slices ([Note: reading only this rank's slices]); every rank calls it (the
    stage publishes the new weights with a collective). ``prefix``: what the module's keys have in front
    of the file's (``"model."`` for a LightningModule holding the Hugging Face model as ``self.model``).
    A tied weight absent from the file (``lm_head.weight`` beside ``model.embed_tokens.weight``) is loaded
    through its twin. ``strict``: missing or unexpected keys are an error naming them."""
    module = _module_of(model)
    targets = _targets(module, prefix)
    aliases = _aliases(module, prefix)
    # An MoE model's experts are read under their global names, each rank its own ([Note: global expert
    # names] in moe/full.py); the other experts' entries are expected in the file, not loaded here.
    experts = ExpertNames(module)
    others: set[str] = set()
    if experts:
        targets = {_global(experts, prefix, k): t for k, t in targets.items()}
        others = {k[len(prefix) :] for k in experts.all_global if k.startswith(prefix)} - set(targets)
    with ExitStack() as stack:
        files = _Files(path, stack)
        present = set(files.where)
        in_file = {k: t for k, t in targets.items() if k in present}
        _refuse_packed(list(in_file), list(in_file.values()), "load_hf_weights")
        twins = {n for a, n in aliases.items() if a in present}  # loaded through another name of the same tensor
        missing = sorted(k for k in targets if k not in present and k not in twins)
        missing += sorted(k for k in others if k not in present)
        unexpected = sorted(k for k in present if k not in targets and k not in aliases and k not in others)
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{path} does not match the model: missing keys {missing[:10]}"
                f"{f' (+{len(missing) - 10} more)' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                f"{f' (+{len(unexpected) - 10} more)' if len(unexpected) > 10 else ''} "
                f"(strict=False loads what matches; prefix={prefix!r} is put in front of the file's keys)"
            )
        publish: dict[int, Any] = {}
        refresh: dict[int, Any] = {}
        for key, target in targets.items():
            source = key if key in present else next((a for a, n in aliases.items() if n == key and a in present), None)
            if source is None:
                continue
            shape, want = files.shape(source), _true_shape(target)
            if tuple(shape) != tuple(want):
                raise CheckpointError(
                    f"{path}: {source} has shape {list(shape)} in the file, {list(want)} in the model"
                )

            def read(a: int, z: int, dtype: torch.dtype, source: str = source) -> torch.Tensor:
                return files.read_flat(source, a, z).to(dtype)

            _write(target, read, publish, refresh, stack)
        for stage in publish.values():
            stage.publish()
        for stage in refresh.values():
            stage.placement.refresh_frozen()


def _refuse_packed(names: list[str], tensors: list[torch.Tensor], what: str) -> None:
    """A bitsandbytes 4-bit / 8-bit weight is packed codes read with a quantization state held elsewhere
    ([Note: packed parameters] in runtime/packed.py): written alone it loads as garbage, read into it a float
    checkpoint would be taken as codes. Refused, naming them."""
    packed = [n for n, t in zip(names, tensors, strict=True) if is_packed(t)]
    if packed:
        raise CheckpointError(
            f"{what}: {len(packed)} weights hold bitsandbytes' packed quantized codes ({', '.join(packed[:3])}"
            f"{' ...' if len(packed) > 3 else ''}), which are not Hugging Face weights without their quantization "
            "state. Save or load the trainable adapters only (exclude_frozen_parameters=True, or peft's "
            "save_pretrained), and load a quantized base with from_pretrained(quantization_config=...)"
        )


def _global(experts: ExpertNames, prefix: str, key: str) -> str:
    """The global name of a key relative to ``prefix`` (an expert's; other keys unchanged)."""
    return experts.to_global(prefix + key)[len(prefix) :]


def _write(
    t: torch.Tensor,
    read: Callable[[int, int, torch.dtype], torch.Tensor],
    publish: dict[int, Any],
    refresh: dict[int, Any],
    stack: ExitStack,
) -> None:
    found = find(t)
    if found is not None:  # trainable in an engine: this rank's fragment of the fp32 masters
        access, g, i = found
        _seen(access.stage, publish, refresh, stack)
        publish[id(access.stage)] = access.stage
        gs = access.stage.groups[g]
        frag = _fragment(gs, i)
        if frag is not None:
            b, at, start, n = frag
            master = gs.masters[b]
            master.data[at : at + n].copy_(read(start, start + n, master.dtype))
        return
    z3 = getattr(t, ZERO3_ATTR, None)
    if z3 is not None:  # frozen at stage 3: this rank's shard of the frozen partition
        stage, g, i = z3
        _seen(stage, publish, refresh, stack)
        refresh[id(stage)] = stage
        gs = stage.storages[g]
        slot = gs.layout.params[i]
        lo, hi = gs.layout.shard_range(slot.bucket, gs.rank)
        a, z = max(lo, slot.offset), min(hi, slot.end)
        if a < z:
            view = gs.layout.partition_view(gs.part, slot.bucket)
            view[a - lo : z - lo].copy_(read(a - slot.offset, z - slot.offset, view.dtype))
        return
    info = init_shard(t)
    if info is not None:  # zero.Init, before any engine: this rank's piece of the flattened parameter
        per = info.per
        lo, hi = min(info.coll.rank * per, info.numel), min((info.coll.rank + 1) * per, info.numel)
        info.write_prefix(read(lo, hi, info.dtype))
        return
    t.data.copy_(read(0, t.numel(), t.dtype).view(t.shape))


def _seen(stage: Any, publish: dict[int, Any], refresh: dict[int, Any], stack: ExitStack) -> None:
    """The first write into ``stage``: bring its NVMe-offloaded partitions in until the load ends."""
    if id(stage) not in publish and id(stage) not in refresh:
        stack.enter_context(stage.resident())


# ---------------------------------------------------------------------------------------------- writing
class ShardWriter:
    """Hugging Face's sharded safetensors layout, written one shard at a time on one process."""

    def __init__(self, save_dir: str | os.PathLike[str], max_shard_size: int | str) -> None:
        self.dir = Path(save_dir)
        self.limit = parse_size(max_shard_size)
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.dir.glob("model*.safetensors"), self.dir / INDEX]:  # an earlier export's shards
            old.unlink(missing_ok=True)
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if self.current and self.current_bytes + size > self.limit:
            self._flush()
        self.current[key] = value.detach().cpu().contiguous().clone()  # own storage: tied copies stay apart
        self.current_bytes += size
        self.total += size

    def _flush(self) -> None:
        part = self.dir / f"model-part-{len(self.parts):05d}.safetensors.tmp"
        _safetensors().torch.save_file(self.current, str(part), metadata={"format": "pt"})
        self.parts.append((part, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def close(self) -> list[Path]:
        if self.current or not self.parts:
            self._flush()
        n = len(self.parts)
        if n == 1:
            final = self.dir / SINGLE
            os.replace(self.parts[0][0], final)
            return [final]
        weight_map, out = {}, []
        for i, (part, keys) in enumerate(self.parts):
            final = self.dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(part, final)
            weight_map.update(dict.fromkeys(keys, final.name))
            out.append(final)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return out


def _full_value(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole value (a collective where it is partitioned), in ``dtype`` or the tensor's own."""
    out = dtype or t.dtype
    found = find(t)
    if found is not None and (out == torch.float32 or getattr(t, ZERO3_ATTR, None) is not None):
        access, g, i = found  # from the fp32 masters (the compute copy is their cast)
        return access.get_full(g, i, "fp32_param").to(out)
    if getattr(t, ZERO3_ATTR, None) is not None:
        from ..zero.gathered import GatheredParameters

        with GatheredParameters([t]):
            return t.detach().to(out, copy=True)
    if init_shard(t) is not None:
        return gather_init_param(t).view(_true_shape(t)).to(out, copy=True)
    return t.detach().to(out)


@torch.no_grad()
def save_hf_weights(
    engine_or_module: Any,
    save_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the model's weights as Hugging Face safetensors (``model.safetensors``, or shards of at most
    ``max_shard_size`` + ``model.safetensors.index.json``), keys relative to the module given (a ZeroEngine's
    module, or any submodule: the Hugging Face model inside a LightningModule). ``dtype``: None keeps each
    weight's training dtype (16-bit under bf16/fp16), ``torch.float32`` writes the fp32 masters.
    ``exclude_frozen_parameters``: the trainable parameters only (LoRA adapters). A collective: every rank
    calls it; rank 0 writes, one shard at a time. Returns the files written (on rank 0; [] elsewhere).
    The model's ``config.json`` is yours to write: ``model.config.save_pretrained(save_dir)``."""
    module = _module_of(engine_or_module)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    writer = ShardWriter(save_dir, max_shard_size) if rank == 0 else None
    targets = _targets(module, "", with_frozen=not exclude_frozen_parameters).items()
    _refuse_packed([k for k, t in targets], [t for k, t in targets], "save_hf_weights")
    # An MoE model's experts: every one, under its global name ([Note: global expert names], moe/full.py).
    for key, value in ExpertNames(module).full_items(
        targets, lambda t: _full_value(t, dtype if t.is_floating_point() else None)
    ):
        if writer is not None:
            writer.add(key, value)
        del value
    files = writer.close() if writer is not None else []
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the files exist on return, on every rank
    return files


def write_hf_fp32(
    pairs: Iterator[tuple[str, torch.Tensor]],
    save_dir: str | os.PathLike[str],
    max_shard_size: int | str,
    prefix: str,
    aliases: Collection[str] = (),
) -> list[Path]:
    """``ds-zero-to-fp32 --safetensors``: consolidated fp32 tensors, streamed into the sharded layout; the
    ``aliases`` (second names of tied weights) are left out, as Hugging Face writes a tied weight once."""
    writer = ShardWriter(save_dir, max_shard_size)
    for key, value in pairs:
        if key not in aliases:
            writer.add(prefix + key, value)
    return writer.close()
