"""The memory model (runtime/memory.py): its terms, DeepSpeed's estimator names, and its ``peak`` against a
measured peak.

The measurement (``python -m tests.runtime.test_memory_model <stage>``, one fresh process per stage): a
12.9M-parameter MLP of 6 residual blocks (fp32, Adam, micro batch 8 x 64 positions x 512 features) on one
CPU process. The activation bytes per sample are what autograd saves in one forward (the unique storages
the ``saved_tensors_hooks`` see, parameters excluded), divided by the micro batch. The measured peak is the
process's resident set at its highest during the third training step (``VmHWM`` after writing 5 to
/proc/self/clear_refs right before it) less the resident set before the model was built, after one tiny
engine was built and destroyed (so that imports, kernels and the allocator's arenas are in the baseline).
``MALLOC_PERTURB_`` makes glibc fill every block it hands out, so an allocation is resident as soon as it
is made, as on a device. Measured on this machine (MiB, estimate / measured): stage 0 258 / 282, stage 1
307 / 327, stage 2 262 / 285, stage 3 278 / 294: the estimate is 5-9% low, within the 15% asked; what it
does not count is autograd's transient gradient tensors and the framework's own allocations.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_strategy
from ds_strategy.runtime import (
    estimate_memory,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_live,
)
from ds_strategy.runtime.memory import largest_fetch_unit, saved_activation_bytes

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15
N = 1_000_000


# ------------------------------------------------------------------------------------------- the terms
def test_model_states_are_unchanged_and_transient_terms_default_to_zero() -> None:
    est = estimate_memory(N, 4, 2, False, "bf16")
    assert est.as_dict() == {"params": 2 * N, "grads": N, "master": N, "optimizer_state": 2 * N}
    assert (est.activations, est.gathered, est.buffers, est.offloaded_params) == (0, 0, 0, 0)
    assert est.peak == est.total == 6 * N and est.peak_on_device == est.on_device == 6 * N


def test_activations_are_bytes_per_sample_times_the_micro_batch() -> None:
    est = estimate_memory(N, 1, 0, activation_bytes_per_sample=3000, micro_batch_size=16)
    assert est.activations == 48_000 and est.peak == est.total + 48_000


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_buffers_are_the_reduce_bucket_in_the_communication_dtype_at_stages_2_and_3(stage: int) -> None:
    est = estimate_memory(N, 2, stage, precision="bf16", bucket_numel=50_000)
    assert est.buffers == (2 * 50_000 if stage >= 2 else 0)
    wide = estimate_memory(N, 2, stage, precision="bf16", bucket_numel=50_000, communication_precision="fp32")
    assert wide.buffers == (4 * 50_000 if stage >= 2 else 0)


def test_stage3_gathers_two_units_bounded_by_the_live_limit_but_never_below_one() -> None:
    unit = 100_000
    assert estimate_memory(N, 4, 3, largest_unit_numel=unit).gathered == 4 * 2 * unit
    assert estimate_memory(N, 4, 3, precision="bf16", largest_unit_numel=unit).gathered == 2 * 2 * unit
    assert estimate_memory(N, 4, 3, largest_unit_numel=unit, max_live_numel=150_000).gathered == 4 * 150_000
    assert estimate_memory(N, 4, 3, largest_unit_numel=unit, max_live_numel=10).gathered == 4 * unit
    assert estimate_memory(N, 4, 2, largest_unit_numel=unit).gathered == 0  # only stage 3 gathers


def test_peak_on_device_leaves_out_what_host_memory_holds() -> None:
    world, unit = 4, 50_000
    est = estimate_memory(
        N,
        world,
        3,
        True,
        "bf16",
        offload_param=True,
        activation_bytes_per_sample=1000,
        micro_batch_size=2,
        largest_unit_numel=unit,
        bucket_numel=10_000,
    )
    share = N // world
    assert est.params == est.offloaded_params == 2 * share
    assert est.offloaded == est.master + est.optimizer_state == 4 * share + 8 * share
    assert est.peak == est.total + 2000 + 2 * 2 * unit + 2 * 10_000
    assert est.peak_on_device == est.grads + 2000 + 2 * 2 * unit + 2 * 10_000
    assert est.on_device == est.grads


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="parameter offload needs ZeRO stage 3"):
        estimate_memory(N, 2, 2, offload_param=True)
    with pytest.raises(ValueError, match="micro_batch_size >= 1"):
        estimate_memory(N, micro_batch_size=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        estimate_memory(N, activation_bytes_per_sample=-1)
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_memory(N, communication_precision="fp8")


def test_top_level_names_resolve() -> None:
    assert ds_strategy.estimate_zero2_model_states_mem_needs_all_live is estimate_zero2_model_states_mem_needs_all_live
    assert ds_strategy.estimate_zero3_model_states_mem_needs_all_live is estimate_zero3_model_states_mem_needs_all_live
    assert ds_strategy.estimate_zero2_model_states_mem_needs is estimate_zero2_model_states_mem_needs
    assert ds_strategy.estimate_zero3_model_states_mem_needs is estimate_zero3_model_states_mem_needs


# ---------------------------------------------------------------------------- DeepSpeed's estimator names
P = 10**9  # a 1B-parameter model on one node of 8 GPUs


def test_zero2_estimate_on_a_known_parameter_count() -> None:
    # bf16 params 2P on every rank; fp32 gradient partition, master and Adam state 16P / 8 each rank.
    assert estimate_zero2_model_states_mem_needs(P, 8, 1, cpu_offload=False) == (int(4 * P * 8 * 1.5), 4 * P)
    # offloaded: master + Adam state (12P / 8 per rank) in host memory, 8 ranks per node; the fp32 model each
    # rank builds first (4P) is larger.
    assert estimate_zero2_model_states_mem_needs(P, 8, 1, cpu_offload=True) == (int(4 * P * 8 * 1.5), 2 * P + P // 2)
    # one GPU: the offloaded 12P exceed the 4P fp32 model.
    assert estimate_zero2_model_states_mem_needs(P, 1, 1, cpu_offload=True, additional_buffer_factor=1) == (
        12 * P,
        2 * P + 4 * P,
    )


def test_zero3_estimate_on_a_known_parameter_count() -> None:
    layer = 10**8
    gathered = 2 * 2 * layer  # bf16, the layer and the next one prefetched
    # nothing offloaded: 18P / 8 per rank (bf16 shard 2, fp32 grads 4, master 4, Adam 8) + the gathered layers.
    cpu, gpu, gathered_bytes = estimate_zero3_model_states_mem_needs(P, layer, 8, 1, False, False, True, 1.0)
    assert (cpu, gpu, gathered_bytes) == (4 * layer * 8, 18 * P // 8 + gathered, gathered)
    cpu, _, _ = estimate_zero3_model_states_mem_needs(P, layer, 8, 1, False, False, False, 1.0)
    assert cpu == 4 * P * 8  # without zero_init every rank builds the whole fp32 model first
    # optimizer offloaded: the shard (2P / 8) and gradient partition (4P / 8) stay; 12P / 8 per rank on the host.
    assert estimate_zero3_model_states_mem_needs(P, layer, 8, 1, True, False, True, 1.0) == (
        12 * P,
        6 * P // 8 + gathered,
        gathered,
    )
    # parameters offloaded too: 14P on the host, the GPU holds the gradient partition and the gathered layers.
    assert estimate_zero3_model_states_mem_needs(P, layer, 8, 1, True, True, True, 1.5) == (
        int(14 * P * 1.5),
        4 * P // 8 + gathered,
        gathered,
    )


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 256, bias=False)  # 16,384
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))  # 65,792 each
        self.head = nn.Linear(256, 8)  # 2,056


def test_all_live_variants_print_the_table_and_return_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    model = _Stack()
    total = sum(p.numel() for p in model.parameters())
    assert largest_fetch_unit(model) == 256 * 256 + 256  # a block (the rest: embed + head = 18,440)
    rows = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    assert rows == [
        (*estimate_zero2_model_states_mem_needs(total, 2, 1, True), "offload_optimizer=cpu"),
        (*estimate_zero2_model_states_mem_needs(total, 2, 1, False), "offload_optimizer=none"),
    ]
    text = capsys.readouterr().out
    assert "per CPU" in text and "per GPU" in text and "offload_optimizer=none" in text and "ZeRO stage 2" in text
    rows3 = estimate_zero3_model_states_mem_needs_all_live(model)
    text = capsys.readouterr().out
    assert [r[2] for r in rows3] == [
        f"offload_param={p}, offload_optimizer={o}, zero_init={z}"
        for p, o in (("cpu", "cpu"), ("none", "cpu"), ("none", "none"))
        for z in (1, 0)
    ]
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, 65_792, 1, 1, False, False, True, 1.5)
    assert rows3[4][:2] == (cpu, gpu)
    assert "zero_init=0" in text and "ZeRO stage 3" in text


# -------------------------------------------------------------------------- estimated vs measured peak
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class MLP(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


MICRO, POSITIONS, WIDTH, DEPTH = 8, 64, 512, 6
BUCKET = 1_000_000  # reduce_bucket_size: a small one, so that the staging buffers are what the model says


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _step(engine: Any, x: torch.Tensor) -> None:
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def measure(stage: int) -> dict[str, Any]:
    """Run in a fresh process (see the module docstring): the estimate and the measured peak of ``stage``."""
    from ds_strategy.runtime.host_memory import trim_heap

    torch.set_num_threads(1)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET},
    }
    warm, *_ = ds_strategy.initialize(model=MLP(8, 2), config={**config, "train_micro_batch_size_per_gpu": 1})
    _step(warm, torch.randn(1, 2, 8))
    warm.destroy()
    del warm
    gc.collect()
    trim_heap()
    x = torch.randn(MICRO, POSITIONS, WIDTH)
    baseline = _status("VmRSS")
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH)
    per_sample = saved_activation_bytes(model, lambda: model(x).float().pow(2).mean()) // MICRO
    params = sum(p.numel() for p in model.parameters())
    unit = sum(p.numel() for p in model.blocks[0].parameters())
    engine, *_ = ds_strategy.initialize(model=model, config=config)
    for _ in range(2):
        _step(engine, x)
    gc.collect()
    trim_heap()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS
    _step(engine, x)
    peak = _status("VmHWM") - baseline
    est = estimate_memory(
        params,
        1,
        stage,
        device="cpu",
        activation_bytes_per_sample=per_sample,
        micro_batch_size=MICRO,
        largest_unit_numel=unit if stage == 3 else 0,
        bucket_numel=min(BUCKET, params) if stage >= 2 else 0,
    )
    return {
        "stage": stage,
        "params": params,
        "activations": est.activations,
        "estimated": est.peak,
        "measured": peak,
        "model_states_measured": sum(engine.memory_breakdown().values()),
        "model_states_estimated": est.total,
    }


def _measured(stage: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "MALLOC_PERTURB_": "165",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.test_memory_model", str(stage)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimated_peak_is_within_15_percent_of_the_measured_peak(stage: int) -> None:
    got = _measured(stage)
    assert 10_000_000 <= got["params"] <= 20_000_000
    assert got["activations"] > 0.2 * got["estimated"]  # the activations are a real part of the peak here
    if stage < 3:  # stage 3 frees its gradient partitions after the step: they are transient there
        assert abs(got["model_states_measured"] - got["model_states_estimated"]) <= 0.01 * got["model_states_estimated"]
    error = abs(got["estimated"] - got["measured"]) / got["measured"]
    assert error <= TOLERANCE, got


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
