"""Peak host memory a ModelCheckpoint save adds at stage 3, per rank, as a multiple of the full model size.

    MALLOC_PERTURB_=165 python -m torch.distributed.run --nproc_per_node 2 checkpoint_memory.py LAYERS WIDTH DIR [ROWS]

A LAYERS x Linear(WIDTH, WIDTH) model (fp32, every parameter partitioned:
``stage3_param_persistence_threshold: 0``) trains with a stateless SGD under ``Trainer(strategy=zero3)``;
ModelCheckpoint saves after every step. A callback that runs just before ModelCheckpoint's (Lightning
orders checkpoint callbacks last) resets VmHWM; the next batch's start reads it, so the window is the save.
MALLOC_PERTURB_ makes glibc write every allocation, as a device allocator commits it. Prints one JSON line
per rank: {"rank", "added", "model", "ratio", "saves"}, and writes it to ROWS/rank<N>.json when ROWS is given
(the ranks' stdout lines can interleave).
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy.lightning as zl
from ds_strategy.accelerator.cpu import process_memory, reset_peak_rss


class Model(pl.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)  # stateless: the save holds no optimizer state


class SavePeak(Callback):
    def __init__(self) -> None:
        self.before = 0
        self.added: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:  # runs before ModelCheckpoint's
        reset_peak_rss()
        self.before = process_memory()[0]

    def on_train_batch_start(self, trainer, *args) -> None:
        if self.before:
            self.added.append((process_memory()[1] or 0) - self.before)


def main() -> None:
    layers, width, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    x = torch.randn(8, width)
    data = DataLoader(TensorDataset(x, x.clone()), batch_size=2)
    probe = SavePeak()
    strategy = zl.ZeroStrategy(stage=3, config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(Model(layers, width), data)
    model_bytes = layers * width * width * 4
    added = max(probe.added)
    row = {"rank": trainer.global_rank, "added": added, "model": model_bytes, "ratio": added / model_bytes}
    line = json.dumps({**row, "saves": len(probe.added)})
    print(line, flush=True)
    if len(sys.argv) > 4:
        Path(sys.argv[4], f"rank{trainer.global_rank}.json").write_text(line)


if __name__ == "__main__":
    main()
