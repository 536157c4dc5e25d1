"""Consolidation: 4 ranks' stage-2 bf16 shards -> one fp32 state dict that the bare module loads strictly
(tied weights shared, buffers included), the ``ds-zero-to-fp32`` script, a Lightning checkpoint that
``LightningModule.load_from_checkpoint`` reads, and shards from two "nodes" merged into one directory.
The consolidated weights are compared bit for bit with the engine's fp32 masters gathered in memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.runtime.common import config, full_masters

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]


class Tied(nn.Module):
    """Embedding tied to the output head, a float and an integer buffer, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Parameter(torch.linspace(0, 1, 10), requires_grad=False)
        self.register_buffer("scale", torch.tensor(1.5))
        self.register_buffer("count", torch.tensor(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.body(self.emb(x))) * self.scale) + self.frozen
        return F.cross_entropy(logits.float(), y)


class Wrapper(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Tied()


def _train_and_save(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    import ds_strategy.runtime as rt

    torch.manual_seed(0)
    model = Tied()
    cfg = config(stage=2, precision="bf16", micro=2, gas=1, bucket=64)
    engine, _, _, _ = rt.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        loss = engine(torch.randint(0, 10, (2,), generator=g), torch.randint(0, 10, (2,), generator=g))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, client_state={"hyper_parameters": {"width": 8}, "epoch": 1})
    masters = full_masters(engine)
    engine.destroy()
    return masters


def test_consolidate_four_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict
    from ds_strategy.runtime.checkpoint.consolidate import main

    root = tmp_path / "ckpt"
    masters = run_distributed(_train_and_save, world_size=4, args=(str(root),))[0]

    state = consolidate_fp32_state_dict(root)
    bare = Tied()
    assert list(state) == list(bare.state_dict())
    bare.load_state_dict(state, strict=True)
    assert state["emb.weight"] is state["head.weight"]  # tied: one tensor under both names
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    assert state["scale"].dtype == torch.float32 and float(state["scale"]) == 1.5
    assert state["count"].dtype == torch.int64 and int(state["count"]) == 3
    assert torch.equal(state["frozen"], torch.linspace(0, 1, 10).bfloat16().float())  # kept in bf16 by the engine

    # the console script: a plain torch file and a Lightning checkpoint
    assert main([str(root), str(tmp_path / "out.pt")]) == 0
    plain = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(plain[k], state[k]) for k in state)
    assert main([str(root), str(tmp_path / "out.ckpt"), "--lightning", "--prefix", "model."]) == 0
    restored = Wrapper.load_from_checkpoint(tmp_path / "out.ckpt", weights_only=True)
    for name, value in restored.model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert restored.hparams["width"] == 8
    if _has_safetensors():
        assert main([str(root), str(tmp_path / "out.safetensors")]) == 0
    else:
        assert main([str(root), str(tmp_path / "out.safetensors")]) == 2
        assert "pip install safetensors" in capsys.readouterr().err

    # shards written on two "nodes" (local disks): node 0 alone is incomplete, merged it works
    tag = (root / "latest").read_text()
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    shutil.copytree(root, node0)
    (node1 / tag).mkdir(parents=True)
    for r in (2, 3):
        shutil.move(node0 / tag / f"zero_rank_{r:05d}_optim_states.pt", node1 / tag)
    assert main([str(node0), str(tmp_path / "partial.pt")]) == 2
    err = capsys.readouterr().err
    assert "zero_rank_00002_optim_states.pt is missing" in err and "copy every node's files" in err
    for f in (node1 / tag).iterdir():
        shutil.copy(f, node0 / tag)
    merged = consolidate_fp32_state_dict(node0)
    assert all(torch.equal(merged[k], state[k]) for k in state)


def _has_safetensors() -> bool:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return False
    return True


def test_console_script_is_declared() -> None:
    text = (REPO / "pyproject.toml").read_text()  # tomllib is 3.11+; the project supports 3.10
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'ds-zero-to-fp32 = "ds_strategy.runtime.checkpoint.consolidate:main"' in scripts
