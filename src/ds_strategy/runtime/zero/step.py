"""The optimizer step of a ZeRO stage: gradients to the masters (multiplied, clipped, copied to the host
when offloaded), the step in tiles of ``sub_group_size`` (DeepSpeed's sub-groups), NVMe's tiled step, the
skip decision kept on the device, and the publish of the updated parameters (the stage's).

The engine calls ``stage.stepper.apply``; this object holds what only the step uses (the host gradient
buffers, the copier that carries offloaded gradients and the skip flag to the host), and reads the stage
through ``StepStage``'s public names. A partial offload (``offload_optimizer.ratio`` < 1) steps the compute
device's masters first and the host's meanwhile ([Note: the partial offload split] in partial_offload.py).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Protocol

import torch
from torch import nn

from ds_strategy.accelerator import strict
from ds_strategy.accelerator.spans import span
from ds_strategy.ops.optimizers import is_kernel_optimizer

from ..host_memory import trim_heap
from ..swap import OptimizerSwapper, Swap
from .buffers import GroupStorage
from .offload_copy import HostCopier
from .partial_offload import MasterSplit
from .per_tensor import WholeTensors


class StepStage(Protocol):
    """What the step reads of its stage (``ZeroStage``)."""

    groups: list[GroupStorage]
    swap: Swap | None
    swapper: OptimizerSwapper | None
    compute_device: torch.device
    master_split: MasterSplit | None  # a partial offload's host / device masters (partial_offload.py)
    whole: WholeTensors | None  # a per-tensor optimizer's tensors (per_tensor.py)

    @property
    def options(self) -> StepOptions: ...

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]: ...

    def publish(self, params_written: Collection[int] = ()) -> None: ...


class StepOptions(Protocol):
    """What the step reads of the stage's options (``StageOptions``)."""

    @property
    def pin_memory(self) -> bool: ...
    @property
    def sub_group_numel(self) -> int: ...


class OptimizerStep:
    """The optimizer step of one stage (see the module docstring)."""

    def __init__(self, stage: StepStage) -> None:
        self.stage = stage
        # fp32 gradient copies on the masters' device: per group (key g), or per side of a partial offload's
        # group (key (g, first master)); the host ones are listed in ``_on_host``.
        self._host_grad_buffers: dict[int | tuple[int, int], list[torch.Tensor]] = {}
        self._on_host: set[int | tuple[int, int]] = set()
        self._host_copier = HostCopier(stage.compute_device)  # offloaded gradients to the host masters
        self._skip_host: torch.Tensor | None = None

    def host_grad_bytes(self) -> int:
        """Bytes of the fp32 gradient copies kept on the host for offloaded masters."""
        return sum(t.numel() * t.element_size() for views in self._host_grad_buffers.values() for t in views)

    def offloaded_grad_bytes(self, offloaded: bool) -> int:
        """Of ``host_grad_bytes``, those of the masters in host memory (``offloaded``: an optimizer offload;
        under a partial one, the host side's); a copy for masters on the compute device is not."""
        return sum(
            t.numel() * t.element_size()
            for key, views in self._host_grad_buffers.items()
            if (key in self._on_host if isinstance(key, tuple) else offloaded)
            for t in views
        )

    def _reduced_grads(self) -> list[torch.Tensor]:
        """This rank's reduced (still scaled) gradients, on the parameters' device, all groups."""
        return [t for g in range(len(self.stage.groups)) for t in self.stage.reduced_grads_of(g)]

    def skip_mode(self, optimizer: torch.optim.Optimizer) -> str:
        """How ``apply_step`` learns whether to skip a step it is handed the device flag of (see [Note: the
        step on the device]): "device", "copy" (offloaded masters: with the gradients' copy) or "read"."""
        if self.stage.swap is not None or any(
            m.device != self.stage.compute_device for gs in self.stage.groups for m in gs.masters
        ):
            return "copy"
        if is_kernel_optimizer(optimizer) or _takes_found_inf(optimizer):
            return "device"
        return "read"

    @torch.no_grad()
    def apply(
        self,
        optimizer: torch.optim.Optimizer,
        factor: float,
        *,
        clip: torch.Tensor | None = None,
        skip: torch.Tensor | None = None,
    ) -> bool | None:
        """Multiply the gradients by ``factor`` (unscale x average) and ``clip`` (the clipping coefficient, a
        device tensor), step the masters unless ``skip`` (the device flag of a non-finite gradient) is set,
        publish. Returns whether the step was skipped where the host learned it, None where only the device
        knows (``skip`` given, "device" mode); without ``skip`` the caller decided already (False).

        [Note: the fused optimizer pass]
        ds_strategy's CPU kernels (``ds_strategy.ops.CPUAdam`` and siblings) read fp32, bf16 or fp16
        gradients, fold ``factor`` in, step, and write the updated 16-bit parameters, all in one pass over
        memory: with them the gradients are neither pre-multiplied nor copied to fp32, and the masters are
        not copied into the parameters afterwards. Other optimizers get fp32 gradients already multiplied.

        [Note: the step on the device]
        The clipping coefficient and the skip decision of a bf16/fp32 step stay device tensors, so the step
        never waits for the device (docs/zero3.md, "No host synchronisation in a step"):
        * "device" (masters on the compute device; ds_strategy's kernel optimizers or a torch optimizer
          that takes ``found_inf``, i.e. built with ``fused=True``): torch's fused optimizers get the flag
          as ``optimizer.found_inf`` and skip on the device, step counts included. The kernels take their
          coefficients as host numbers, so the gradients are multiplied by ``clip`` on the device first,
          and a step to skip has a NaN put in every gradient (``clip`` or, without clipping, the first
          element times NaN): each kernel call then skips itself on the device (``skip_on_device``). Their
          step counts are host numbers and still advance (see [Note: step counts on the host] in
          ops/optimizers.py).
        * "copy" (offloaded or NVMe masters: the step runs on the host anyway): the flag comes to the host
          with the gradients' copy, in the same wait, and a step to skip is skipped there.
        * "read" (another torch optimizer on the device: it cannot skip on the device): one host read of
          the flag per optimizer step, documented and allowed under the device-strict mode.
        """
        mode = "given" if skip is None else self.skip_mode(optimizer)
        if mode == "read":
            with strict.host_read_allowed(READ_SKIP):
                if bool(skip):
                    return True
            mode, skip = "given", None
        if self.stage.swap is not None:
            return self._apply_step_tiled(optimizer, factor, clip, skip)
        fused = is_kernel_optimizer(optimizer)
        if not fused:
            pieces = self._reduced_grads()
            scale: float | torch.Tensor = factor if clip is None else clip * factor
            if pieces and (isinstance(scale, torch.Tensor) or scale != 1.0):
                torch._foreach_mul_(pieces, scale)
        elif clip is not None or mode == "device":
            pieces = [p for p in self._reduced_grads() if p.numel()]
            if clip is not None:
                poisoned = torch.where(skip > 0, math.nan, clip) if skip is not None and mode == "device" else clip
                torch._foreach_mul_(pieces, poisoned.to(self.stage.compute_device))
            elif pieces and skip is not None:  # a NaN in every kernel call's gradients, or a multiplication by one
                heads = [p.as_strided((1,), (1,)) for p in pieces]  # each piece's first element
                torch._foreach_mul_(heads, torch.where(skip > 0, math.nan, 1.0))
        outputs: dict[torch.Tensor, torch.Tensor] = {}
        written: set[int] = set()
        to_host: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}  # master -> (host copy, gradient)
        split = self.stage.master_split
        for g, gs in enumerate(self.stage.groups):
            grads = self.stage.reduced_grads_of(g)
            # A partial offload's group has a host side and a device side, each with its own copies (or none).
            sides = [(0, len(gs.masters), None)] if split is None else split.sides(g, len(gs.masters))
            for lo, hi, on_host in sides:
                masters, side = gs.masters[lo:hi], grads[lo:hi]
                device = masters[0].device if masters else None
                if side and (side[0].device != device or (side[0].dtype != torch.float32 and not fused)):
                    # offload / non-fp32 accumulation: fp32 copies on the master device
                    host = self._host_grads(g) if on_host is None else self._side_grads(g, lo, hi, on_host)
                    to_host.update(zip(masters, zip(host, side, strict=True), strict=True))
                    side = host
                for master, grad in zip(masters, side, strict=True):
                    master.grad = grad
            if fused and (sixteen := gs.sixteen_bit_outputs()):
                outputs.update(sixteen)
                written.add(g)
        tiles = self.tile_sets()
        order = [m for gs in self.stage.groups for m in gs.masters if m in to_host]
        # Every tile's copies are issued now; each tile waits for its own before its step (offload_copy.py).
        # "copy" mode: the skip flag travels with the first tile's gradients (one wait for both).
        flag = self._skip_flag_host() if mode == "copy" and skip is not None else None
        with_flag = [(flag, skip.reshape(1).float())] if flag is not None and skip is not None else []
        with strict.host_read_allowed(OFFLOAD_COPY):
            waits = [
                self._host_copier.copy([to_host[m] for m in order if m in tile] + (with_flag if t == 0 else []))
                for t, tile in enumerate(tiles)
            ]
            if with_flag and not tiles:  # no master here: the flag alone
                waits = [self._host_copier.copy(with_flag)]
        if flag is not None:
            waits[0]()
            if not tiles:
                waits = []
            if flag[0] > 0:  # host memory: no read of the device
                for wait in waits[1:]:
                    wait()
                for gs in self.stage.groups:
                    for master in gs.masters:
                        master.grad = None
                return True
        for tile, wait in zip(tiles, waits, strict=True):
            wait()
            # Only the tile's masters carry a gradient: optimizers skip the others, so the step's temporaries
            # scale with the tile (the optimizers ZeRO accepts are elementwise: tiles give the same weights).
            hidden: dict[nn.Parameter, torch.Tensor | None] = {
                m: m.grad for gs in self.stage.groups for m in gs.masters if m not in tile
            }
            for m in hidden:
                m.grad = None
            if self.stage.whole is not None:  # a per-tensor optimizer reads its tensors' views of the grads
                self.stage.whole.bind_grads(tile)
            with span("ds::optimizer_step"):
                if fused:
                    out = {m: t for m, t in outputs.items() if m in tile}
                    optimizer.step(  # type: ignore[call-overload]
                        clip_coef=factor, out_16bit=out or None, skip_on_device=mode == "device"
                    )
                elif mode == "device":
                    _step_with_found_inf(optimizer, skip)
                elif self.stage.whole is not None:  # a per-tensor optimizer's own reads are its own
                    with strict.host_read_allowed(PER_TENSOR_STEP):
                        optimizer.step()
                else:
                    optimizer.step()
            for m, saved in hidden.items():
                m.grad = saved
        if self.stage.whole is not None:
            self.stage.whole.clear_grads()
        for gs in self.stage.groups:
            for master in gs.masters:
                master.grad = None
        self.stage.publish(params_written=written)
        return None if mode == "device" else False

    def _skip_flag_host(self) -> torch.Tensor:
        """The host buffer the skip flag of a "copy"-mode step lands in (pinned with the masters)."""
        buf = self._skip_host
        if buf is None:
            buf = self._skip_host = torch.zeros(1, dtype=torch.float32, pin_memory=self.stage.options.pin_memory)
        return buf

    def tile_sets(self) -> list[set[nn.Parameter]]:
        """The masters in optimizer-step tiles of at most ``sub_group_size`` elements (DeepSpeed's sub-groups),
        in layout order; a master larger than that is a tile of its own. One tile when everything fits."""
        return [set(tile) for tile in self.tiles()]

    def tiles(self) -> list[list[nn.Parameter]]:
        """``tile_sets`` as lists. A partial offload's device masters come first: their tiles are launched
        before the host's are stepped ([Note: the partial offload split])."""
        groups, split = self.stage.groups, self.stage.master_split
        if split is None:
            return self._chunk(m for gs in groups for m in gs.masters)
        on_device = [m for g, gs in enumerate(groups) for m in gs.masters[split.host_counts[g] :]]
        on_host = [m for g, gs in enumerate(groups) for m in gs.masters[: split.host_counts[g]]]
        return self._chunk(on_device) + self._chunk(on_host)

    def _chunk(self, masters: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
        tiles: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        filled = 0
        for m in masters:
            numel = (
                self.stage.swapper.numel[m] if self.stage.swapper is not None else m.numel()
            )  # swapped: a placeholder
            if current and filled + numel > self.stage.options.sub_group_numel:
                tiles.append(current)
                current, filled = [], 0
            current.append(m)
            filled += numel
        if current:
            tiles.append(current)
        return tiles

    @torch.no_grad()
    def _apply_step_tiled(
        self,
        optimizer: torch.optim.Optimizer,
        factor: float,
        clip: torch.Tensor | None = None,
        skip: torch.Tensor | None = None,
    ) -> bool:
        """``apply_step`` with NVMe offload: tile by tile, each tile's masters, state and gradients brought in
        by the swapper (``runtime/swap/optimizer.py``, [Note: the step pipeline]) and its updated parameters
        written out before the next (swapped partitions cannot wait for a whole-model ``publish``). The
        arithmetic per element is ``apply_step``'s. The clipping coefficient and skip flag are read on the
        host once (the step runs there), and every copy between the device and the host is this path's
        business: allowed under the device-strict mode."""
        with strict.host_read_allowed(OFFLOAD_COPY):
            return self._apply_tiles(optimizer, factor, clip, skip)

    def _apply_tiles(
        self, optimizer: torch.optim.Optimizer, factor: float, clip: torch.Tensor | None, skip: torch.Tensor | None
    ) -> bool:
        if clip is not None or skip is not None:
            dev = (clip if clip is not None else skip).device  # type: ignore[union-attr]
            one = torch.ones((), dtype=torch.float64, device=dev)
            coef, skipped = torch.stack(
                [one if clip is None else clip.double(), one * 0 if skip is None else skip.double()]
            ).tolist()
            if skipped > 0:
                return True
            factor *= coef
        fused = is_kernel_optimizer(optimizer)
        tiles = self.tiles()
        where = {m: (g, b) for g, gs in enumerate(self.stage.groups) for b, m in enumerate(gs.masters)}
        sw = self.stage.swapper

        def run(t: int) -> None:
            outputs: dict[torch.Tensor, torch.Tensor] = {}
            for m in tiles[t]:
                g, b = where[m]
                grad = sw.grad_of[m] if sw is not None and m in sw.grad_of else self.stage.reduced_grads_of(g)[b]
                if grad.device != m.device or (grad.dtype != torch.float32 and not fused):
                    grad = grad.to(m.device, torch.float32)
                if not fused and factor != 1.0:
                    grad.mul_(factor)
                m.grad = grad
                out = self.stage.groups[g].sixteen_bit_output(b) if fused else None
                if out is not None:
                    outputs[m] = out
            with span("ds::optimizer_step"):
                if fused:
                    optimizer.step(clip_coef=factor, out_16bit=outputs or None)  # type: ignore[call-overload]
                else:
                    optimizer.step()
            for m in tiles[t]:
                m.grad = None
                g, b = where[m]
                if m in outputs:
                    self.stage.groups[g].store_sixteen_bit_output(b, outputs[m])
                else:
                    self.stage.groups[g].copy_master_to_param(b)

        if sw is not None:
            sw.optimizer = optimizer
            sw.step(tiles, run)
        else:
            for t in range(len(tiles)):
                run(t)
        self.stage.publish(params_written=range(len(self.stage.groups)))
        trim_heap()  # [Note: host memory under NVMe offload] in runtime/swap/__init__.py
        return False

    def _host_grads(self, group: int) -> list[torch.Tensor]:
        buffers = self._host_grad_buffers
        if group not in buffers:
            gs = self.stage.groups[group]
            numel = sum(m.numel() for m in gs.masters)
            buf = torch.empty(
                numel, dtype=torch.float32, device=gs.masters[0].device, pin_memory=self.stage.options.pin_memory
            )
            buffers[group] = gs.master_shaped(buf)
        return buffers[group]

    def _side_grads(self, group: int, lo: int, hi: int, on_host: bool) -> list[torch.Tensor]:
        """``_host_grads`` for masters ``lo:hi`` of a partial offload's group: one buffer on their device."""
        key = (group, lo)
        if key not in self._host_grad_buffers:
            masters = self.stage.groups[group].masters[lo:hi]
            buf = torch.empty(
                sum(m.numel() for m in masters),
                dtype=torch.float32,
                device=masters[0].device,
                pin_memory=self.stage.options.pin_memory and on_host,
            )
            views, at = [], 0
            for m in masters:
                views.append(buf[at : at + m.numel()].view_as(m))
                at += m.numel()
            self._host_grad_buffers[key] = views
            if on_host:
                self._on_host.add(key)
        return self._host_grad_buffers[key]


# The host reads of a bf16/fp32 step that [Note: the step on the device] allows (strict.host_read_allowed).
READ_SKIP = "the skip flag of an optimizer that cannot skip on the device (a torch optimizer without fused=True)"
OFFLOAD_COPY = "offloaded optimizer: gradients and the step's flags to the host masters"
PER_TENSOR_STEP = "a per-tensor optimizer's own step (torch.optim.Adafactor reads its step count on the host)"
TORCH_FUSED = "torch's fused optimizer moves found_inf to its parameters' device (no copy on a GPU)"


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """A torch optimizer whose step skips on the device when ``optimizer.found_inf`` is set (the fused ones,
    as ``torch.amp.GradScaler`` drives them)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and not is_kernel_optimizer(optimizer)


def _step_with_found_inf(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
    """``optimizer.step()`` skipping on the device when ``skip`` (a 0-dim float32 flag) is set."""
    optimizer.found_inf = skip  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    try:
        # Under the strict mode torch sees cpu:0 against its parameters' plain cpu and copies the flag.
        with strict.host_read_allowed(TORCH_FUSED):
            optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
