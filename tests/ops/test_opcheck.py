"""torch.library.opcheck on every op the extension registers under ``torch.ops.ds_strategy``.

opcheck runs each op under schema checking (an in-place update the schema does not declare as
``Tensor(a!)`` fails), checks the autograd registration, compares the fake (meta) kernels of
ops/fake_kernels.py with the real outputs and traces the op through AOT dispatch. ``CASES`` holds a
representative call per op; a test proves it covers every registered op, so a new op cannot go unchecked.
CUDA kernels register CUDA implementations of the same ops (checked on a GPU by tests/ops/test_fused_adam_cuda.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@dataclass(frozen=True)
class Case:
    args: Callable[[], tuple[Any, ...]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    test_utils: tuple[str, ...] = ALL_UTILS
    why_fewer: str = ""  # the reason, when test_utils leaves some out


def _t(n: int = 33, dtype: torch.dtype = torch.float32, positive: bool = False) -> torch.Tensor:
    x = torch.randn(n)
    return (x.abs() if positive else x).to(dtype)


ADAM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "step": 3}


def _detached_storage() -> torch.Tensor:
    # A 0-element tensor over a 40-byte storage: the schema check can compare it before and after the
    # storage is released (a tensor with elements over a released storage has nothing to compare).
    x = torch.empty(0)
    x.set_(torch.empty(10).untyped_storage(), 0, (0,))
    return x


CASES: dict[str, list[Case]] = {
    "adam_step_": [
        Case(
            lambda: ([_t(), _t(7)], [_t(), _t(7)], [_t(), _t(7)], [_t(positive=True), _t(7, positive=True)], []),
            {**ADAM, "adamw_mode": True, "bias_correction": True},
        ),
        Case(  # bf16 gradients, fp16 copies written, unscale + clip, skip on non-finite
            lambda: ([_t()], [_t(dtype=torch.bfloat16)], [_t()], [_t(positive=True)], [_t(dtype=torch.float16)]),
            {
                **ADAM,
                "adamw_mode": False,
                "bias_correction": False,
                "grad_scale": 128.0,
                "clip_coef": 0.5,
                "skip_if_nonfinite": True,
            },
        ),
    ],
    "adagrad_step_": [
        Case(
            lambda: ([_t()], [_t(dtype=torch.float16)], [_t(positive=True)], [_t(dtype=torch.bfloat16)]),
            {"lr": 0.1, "lr_decay": 0.01, "eps": 1e-10, "weight_decay": 0.0, "step": 2, "grad_scale": 4.0},
        )
    ],
    "lion_step_": [
        Case(
            lambda: ([_t(), _t(5)], [_t(), _t(5)], [_t(), _t(5)], []),
            {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "clip_coef": 0.25},
        )
    ],
    "optim_traffic_ceiling_": [Case(lambda: ([_t()], [_t()], [_t()], [_t()]))],
    "multi_tensor_l2norm": [
        Case(lambda: ([_t(), _t(9, torch.bfloat16), _t(4, torch.float16)],)),
        Case(lambda: ([torch.tensor([1.0, float("inf")])],)),
    ],
    "multi_tensor_sum_of_squares": [
        Case(lambda: ([_t(), _t(9, torch.bfloat16), _t(4, torch.float16)],)),
        Case(lambda: ([torch.tensor([1.0, float("inf")])],)),
    ],
    "quantize_blockwise": [
        Case(lambda: (_t(37), 8, 8)),
        Case(lambda: (_t(40, torch.bfloat16).view(4, 10), 4, 4)),
    ],
    "dequantize_blockwise_": [
        Case(lambda: (*torch.ops.ds_strategy.quantize_blockwise(_t(37), 8, 8), 8, 8, torch.empty(37))),
        Case(lambda: (*torch.ops.ds_strategy.quantize_blockwise(_t(30).view(3, 10), 4, 4), 4, 4, _t(30).view(3, 10))),
    ],
    "dequantize_sum_": [
        Case(lambda: (*torch.ops.ds_strategy.quantize_blockwise(_t(39).view(3, 13), 4, 4), 4, 4, torch.empty(13))),
    ],
    "simd_isa": [
        Case(
            lambda: (),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
            why_fewer="AOT dispatch cannot compare str outputs (torch.testing has no str comparison pair)",
        )
    ],
    "host_pool_trim": [Case(lambda: ())],
    "host_pool_stats": [Case(lambda: ())],
    "host_pool_resize_": [
        Case(
            lambda: (_detached_storage(), 0),
            test_utils=("test_schema", "test_autograd_registration"),
            why_fewer="it swaps a storage's memory: no fake kernel (meaningless under tracing, see fake_kernels.py)",
        )
    ],
}


def _registered_ops() -> set[str]:
    prefix = "ds_strategy::"
    return {name[len(prefix) :] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)}


def test_cases_cover_every_registered_op(cpu_kernels: bool) -> None:
    assert _registered_ops() == set(CASES), "add a representative call for each new op to CASES"


def test_in_place_ops_declare_their_mutation(cpu_kernels: bool) -> None:
    # The trailing underscore says "in place"; the schema must say which arguments it writes, and an op
    # without the underscore must write none (opcheck's schema test then proves the declaration true).
    for name in _registered_ops():
        schema = getattr(torch.ops.ds_strategy, name).default._schema
        writes = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert bool(writes) == name.endswith("_"), f"{name}: {schema}"


@pytest.mark.parametrize(
    ("name", "index"), [(name, i) for name, cases in sorted(CASES.items()) for i in range(len(cases))]
)
def test_opcheck(cpu_kernels: bool, name: str, index: int) -> None:
    case = CASES[name][index]
    assert (case.test_utils == ALL_UTILS) != bool(case.why_fewer), "say why a case skips opcheck's tests"
    op = getattr(torch.ops.ds_strategy, name).default
    result = torch.library.opcheck(op, case.args(), case.kwargs, test_utils=case.test_utils)
    assert set(result.values()) == {"SUCCESS"}, result
