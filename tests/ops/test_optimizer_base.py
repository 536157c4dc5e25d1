"""The optimizers ds_strategy creates leave torch._dynamo unimported ([Note: torch._dynamo stays
unimported] in ops/optimizer_base.py): construction, steps, an engine with CPU offload and its checkpoint
save and load, in a fresh interpreter; torch's own optimizer still imports it (the check can fail). The
state dicts are torch's, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys, tempfile
import torch
from torch import nn
import ds_strategy
from ds_strategy.ops.optimizers import CPUAdam

def loaded():
    return "torch._dynamo" in sys.modules

torch.manual_seed(0)
p = nn.Parameter(torch.randn(8, 4))
opt = CPUAdam([p], lr=0.1, adamw_mode=True)
p.grad = torch.randn(8, 4)
opt.step()
sd = opt.state_dict()
again = CPUAdam([nn.Parameter(p.detach().clone())], lr=0.5)
again.load_state_dict(sd)
assert again.param_groups[0]["lr"] == 0.1
assert not loaded(), "CPUAdam imported torch._dynamo"

model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}
engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=config)
loss = engine(torch.randn(2, 8)).sum()
engine.backward(loss)
engine.step()
with tempfile.TemporaryDirectory() as d:
    engine.save_checkpoint(d)
    engine.load_checkpoint(d)
engine.destroy()
assert not loaded(), "the engine imported torch._dynamo"

torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
assert loaded(), "torch's own optimizer no longer imports torch._dynamo: the note is out of date"
print("OK")
"""


@pytest.mark.kernels
def test_our_optimizers_and_an_offloaded_engine_leave_torch_dynamo_unimported(cpu_kernels: bool) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
