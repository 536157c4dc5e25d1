"""Fake (meta) kernels of the compiled ops: output shapes, dtypes and devices without running them.

They let FakeTensor tracing (torch.compile, torch.export, ``torch.library.opcheck``) see through the
ops. The optimizer steps and the norm return 0-dim float32 tensors on their inputs' device (the in-place
updates are declared by the schemas' ``Tensor(a!)`` annotations, so no fake work is needed for them).
``host_pool_resize_`` has none on purpose: it swaps a storage's memory, which has no meaning under
tracing. Registered once, right after the library is loaded (builder.load_cpu_kernels).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _flag_like(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.empty((), dtype=torch.float32, device=device)


def _step_fake(params: Sequence[torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
    return _flag_like(params)


def _traffic_ceiling_fake(*args: object) -> None:
    return None


def _l2norm_fake(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _flag_like(tensors), _flag_like(tensors)


def _sum_of_squares_fake(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    flag = _flag_like(tensors)
    return flag.to(torch.float64), flag


def _quantize_fake(x: torch.Tensor, block_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    packed = (n + 1) // 2 if bits == 4 else n
    blocks = (n + block_size - 1) // block_size
    lead = tuple(x.shape[:-1])
    return x.new_empty((*lead, packed), dtype=torch.int8), x.new_empty((*lead, blocks), dtype=torch.float32)


_registered: list[bool] = []  # torch refuses a second fake kernel for an op: register once per process


def register_fake_kernels() -> None:
    if _registered:
        return
    _registered.append(True)
    for name in ("adam_step_", "adagrad_step_", "lion_step_"):
        torch.library.register_fake(f"ds_strategy::{name}", _step_fake)
    torch.library.register_fake("ds_strategy::optim_traffic_ceiling_", _traffic_ceiling_fake)
    torch.library.register_fake("ds_strategy::multi_tensor_l2norm", _l2norm_fake)
    torch.library.register_fake("ds_strategy::multi_tensor_sum_of_squares", _sum_of_squares_fake)
    torch.library.register_fake("ds_strategy::quantize_blockwise", _quantize_fake)
    for name in ("dequantize_blockwise_", "dequantize_sum_"):
        torch.library.register_fake(f"ds_strategy::{name}", _traffic_ceiling_fake)
