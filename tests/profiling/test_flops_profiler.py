"""ds_strategy.profiling: flops and parameters against hand-computed numbers (issue 23, criterion 2).

Every matmul-type op of a forward costs 2 flops per multiply-accumulate: a Linear on (rows, in) -> (rows,
out) is ``2 * rows * in * out`` flops (the bias is not counted), ``a @ b`` of (m, k) x (k, n) is ``2*m*k*n``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.profiling import FlopsProfiler, get_model_profile
from ds_strategy.profiling.units import duration_to_string, macs_to_string, number_to_string, params_to_string

B, D_IN, D_HID, D_OUT = 3, 8, 16, 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


MLP_FLOPS = 2 * B * D_IN * D_HID + 2 * B * D_HID * D_OUT
MLP_PARAMS = D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT


class Block(nn.Module):
    """A pre-norm transformer block: fused qkv, attention, output projection, a 4x MLP."""

    def __init__(self, d: int = 16, heads: int = 2, sdpa: bool = False) -> None:
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            a = scores.softmax(-1) @ v
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


def block_flops(b: int, s: int, d: int, heads: int) -> int:
    """Hand count of one Block forward."""
    dh = d // heads
    qkv = 2 * b * s * d * (3 * d)
    scores = 2 * b * heads * s * s * dh  # q @ k^T: (s, dh) x (dh, s) per head
    mix = 2 * b * heads * s * s * dh  # softmax(scores) @ v: (s, s) x (s, dh) per head
    out = 2 * b * s * d * d
    mlp = 2 * b * s * d * (4 * d) + 2 * b * s * (4 * d) * d
    return qkv + scores + mix + out + mlp


def block_params(d: int) -> int:
    return 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)


def test_mlp_totals_equal_the_hand_count() -> None:
    flops, macs, params = get_model_profile(MLP(), input_shape=(B, D_IN), print_profile=False, as_string=False)
    assert flops == MLP_FLOPS
    assert macs == MLP_FLOPS // 2
    assert params == MLP_PARAMS


def test_mlp_as_strings() -> None:
    assert get_model_profile(MLP(), args=[torch.randn(B, D_IN)], print_profile=False) == (
        number_to_string(MLP_FLOPS),
        macs_to_string(MLP_FLOPS // 2),
        params_to_string(MLP_PARAMS),
    )


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul-attention", "sdpa"])
def test_transformer_block_totals_equal_the_hand_count(sdpa: bool) -> None:
    b, s, d, heads = 2, 5, 16, 2
    block = Block(d, heads, sdpa=sdpa)
    flops, macs, params = get_model_profile(
        block, kwargs={"x": torch.randn(b, s, d)}, print_profile=False, as_string=False
    )
    assert flops == block_flops(b, s, d, heads)
    assert macs == flops // 2
    assert params == block_params(d)


def test_per_module_counts_are_inclusive_and_ignored_modules_drop_out() -> None:
    b, s, d, heads = 2, 5, 16, 2
    block = Block(d, heads)
    prof = FlopsProfiler(block)
    prof.start_profile()
    block(torch.randn(b, s, d))
    prof.stop_profile()
    assert prof.module_flops(block.qkv) == 2 * b * s * d * 3 * d
    assert prof.module_flops(block.mlp) == 2 * b * s * d * 4 * d * 2
    assert prof.module_params(block.mlp) == d * 4 * d + 4 * d + 4 * d * d + d
    assert prof.get_total_flops() == block_flops(b, s, d, heads)
    assert float(prof.get_total_duration()) > 0
    assert prof.module_duration(block.mlp) <= float(prof.get_total_duration())
    prof.end_profile()

    # ignore_modules: the Sequential MLP's flops (its Linears') enter no total
    flops, _, _ = get_model_profile(
        block, args=[torch.randn(b, s, d)], print_profile=False, as_string=False, ignore_modules=[nn.Sequential]
    )
    assert flops == block_flops(b, s, d, heads) - 2 * b * s * d * 4 * d * 2


def test_profiler_lifecycle_like_deepspeed(capsys: pytest.CaptureFixture[str]) -> None:
    model = MLP()
    prof = FlopsProfiler(model)
    prof.print_model_profile()  # before start_profile: nothing
    assert capsys.readouterr().out == ""
    prof.start_profile()
    model(torch.randn(B, D_IN))
    model(torch.randn(B, D_IN))  # two forwards while profiling: both count
    prof.stop_profile()
    model(torch.randn(B, D_IN))  # after stop_profile: not counted
    assert prof.get_total_flops() == 2 * MLP_FLOPS
    assert prof.get_total_macs(as_string=True) == macs_to_string(MLP_FLOPS)
    assert prof.get_total_params(as_string=True) == params_to_string(MLP_PARAMS)
    prof.start_profile()  # a restart resets the counts
    model(torch.randn(B, D_IN))
    prof.stop_profile()
    assert prof.get_total_flops() == MLP_FLOPS
    prof.print_model_profile(profile_step=7, detailed=True)
    out = capsys.readouterr().out
    assert "Flops profile at step 7" in out and "fc1 (Linear)" in out
    prof.end_profile()
    prof.print_model_profile()  # after end_profile: nothing
    assert capsys.readouterr().out == ""
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_print_options_and_output_file(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "profile.txt"
    model = nn.Sequential(MLP(), nn.Sequential(nn.Linear(D_OUT, 2)))
    x = torch.randn(B, D_IN)
    get_model_profile(model, args=[x], output_file=str(out), module_depth=1, top_modules=2, detailed=False)
    text = out.read_text()
    assert "Flops profile at step 1" in text
    assert "Per-module profile" not in text  # detailed=False
    depth_rows = [line for line in text.splitlines() if line.startswith("│ ") and "Sequential:" in line]
    assert [r.split("│")[1].strip() for r in depth_rows] == ["0", "1"]  # depths 0..module_depth
    assert "MLP: " in text and "Sequential: " in text  # top 2 types at depth 1

    get_model_profile(model, args=[x], output_file=str(out), detailed=True)
    text = out.read_text()
    assert "Per-module profile" in text and "fc2 (Linear)" in text
    assert params_to_string(MLP_PARAMS + D_OUT * 2 + 2) in text


def test_unit_strings() -> None:
    assert number_to_string(1_234_000) == "1.23 M"
    assert number_to_string(0) == "0 "
    assert macs_to_string(2.5e9) == "2.5 GMACs"
    assert params_to_string(1.3e9) == "1.3 B"
    assert duration_to_string(0.0042) == "4.2 ms"


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="give input_shape, args or kwargs"):
        get_model_profile(MLP())
    with pytest.raises(ValueError, match="input_shape must be a non-empty tuple"):
        get_model_profile(MLP(), input_shape=[B, D_IN])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        get_model_profile(object())  # type: ignore[arg-type]


def _deepspeed_and_ours(rank: int, world: int) -> list[tuple[Any, Any]]:
    pytest.importorskip("deepspeed")
    from deepspeed.profiling.flops_profiler import get_model_profile as deepspeed_profile

    out = []
    for model, x in ((MLP(), torch.randn(B, D_IN)), (Block(16, 2), torch.randn(2, 5, 16))):
        kw: dict[str, Any] = {"args": [x], "print_profile": False, "as_string": False}
        out.append((deepspeed_profile(model, **kw), get_model_profile(model, **kw)))
    return out


@pytest.mark.multiprocess
def test_macs_and_params_equal_deepspeeds() -> None:
    """DeepSpeed's own profiler (its formulas patched into torch's functions) agrees on MACs and params;
    its flops are higher by the elementwise ops it also counts (bias adds, activations, norms, softmax)."""
    from tests.harness import run_distributed

    (pairs,) = run_distributed(_deepspeed_and_ours, 1, process_env={"DS_ACCELERATOR": "cpu"}, timeout=180)
    for (ds_flops, ds_macs, ds_params), (flops, macs, params) in pairs:
        assert (macs, params) == (ds_macs, ds_params)
        assert flops == 2 * macs < ds_flops
