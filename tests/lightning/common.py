"""Shared pieces of the Lightning tests: a small LightningModule, data, and the per-rank Trainer runs.

The Trainer runs happen inside ``tests.harness.run_distributed`` workers with the environment torchrun
would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID): Lightning's
``TorchElasticEnvironment`` picks them up and launches nothing, so a Trainer run costs ~1 s instead of
the seconds a fresh process pair would. Everything a test inspects is returned per rank.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

D_IN, D_HIDDEN, D_OUT = 16, 32, 4
ROWS = 64
# What the harness sets plus the marker that makes Lightning treat the worker as torchrun-launched.
ELASTIC_ENV = {"TORCHELASTIC_RUN_ID": "ds-strategy-tests"}


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed noisy linear regression problem (the same on every rank and in every run)."""

    def __init__(self, rows: int = ROWS, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(rows, D_IN, generator=g)
        w = torch.randn(D_IN, D_OUT, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(rows, D_OUT, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class LitNet(pl.LightningModule):
    """An MLP regression module; options switch on the features under test.

    scheduler: None, "step" or "epoch" (StepLR with that interval). manual: automatic_optimization off;
    manual_clip: with manual, ``self.clip_gradients(opt, manual_clip, "norm")`` before each ``opt.step()``.
    build_in_configure_model: layers are created in configure_model instead of __init__.
    optimizers: how many optimizers configure_optimizers returns (2: the "more than one" case).
    """

    def __init__(
        self,
        lr: float = 0.05,
        scheduler: str | None = None,
        manual: bool = False,
        build_in_configure_model: bool = False,
        optimizers: int = 1,
        return_optimizer: bool = True,
        optimizer: str = "adam",
        manual_clip: float | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.net: nn.Module | None = None if build_in_configure_model else self._build()
        self.val_mse = torchmetrics.MeanSquaredError()
        # Device tensors, read when asked (train_losses): training_step runs inside the engine's forward,
        # where the device-strict mode refuses host reads (docs/zero3.md, "No host synchronisation in a step").
        self.step_losses: list[torch.Tensor] = []
        self.built_in_configure_model = False

    @property
    def train_losses(self) -> list[float]:
        return [float(t) for t in self.step_losses]

    @staticmethod
    def _build() -> nn.Module:
        return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._build()
            self.built_in_configure_model = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y.float())
        self.step_losses.append(loss.detach())
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        assert not isinstance(opt, list)
        opt.zero_grad()
        # Two backward calls per step: the engine must accumulate them and reduce once, at step().
        self.manual_backward(loss * 0.5)
        loss2 = F.mse_loss(self(x).float(), y.float())
        self.manual_backward(loss2 * 0.5)
        if self.hparams["manual_clip"] is not None:
            self.clip_gradients(opt, gradient_clip_val=self.hparams["manual_clip"], gradient_clip_algorithm="norm")
        opt.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        pred = self(x).float()
        self.val_mse(pred, y.float())
        self.log("val_mse", self.val_mse, on_epoch=True)
        self.log("val_loss", F.mse_loss(pred, y.float()), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x).float(), y.float()), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0]).float()

    def configure_optimizers(self) -> Any:
        if not self.hparams["return_optimizer"]:
            return None

        def make() -> torch.optim.Optimizer:
            if self.hparams["optimizer"] == "sgd":  # gradient-scale sensitive, unlike Adam
                return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
            return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])

        opts = [make() for _ in range(self.hparams["optimizers"])]
        if self.hparams["optimizers"] > 1:
            return opts
        sched = self.hparams["scheduler"]
        if sched is None:
            return opts[0]
        step = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2 if sched == "step" else 1, gamma=0.5)
        return {"optimizer": opts[0], "lr_scheduler": {"scheduler": step, "interval": sched}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(), batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(rows=32, seed=8), batch_size=8)

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(rows=32, seed=9), batch_size=8)

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(rows=16, seed=10), batch_size=8)


class LrRecorder(Callback):
    """The lr of each optimizer step (read right after it)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


class EngineProbe(Callback):
    """What the engine looked like at the end of training (the strategy releases it at teardown)."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and engine.global_steps > len(self.grad_norms):  # once per optimizer step
            self.grad_norms.append(float(engine.get_global_grad_norm()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        self.info = {
            "loss_scale": engine.loss_scale,
            "compute_dtype": str(engine.precision.compute_dtype),
            "param_dtype": str(next(pl_module.parameters()).dtype),
            "stage": engine.zero_optimization_stage(),
            "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "gradient_clipping": engine.config.gradient_clipping,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "precision_plugin": type(trainer.precision_plugin).__name__,
            "optimizer": type(engine.optimizer).__name__,
            "grad_norms": self.grad_norms,
            "micro_steps": engine.micro_steps,
            "is_compiled": engine.is_compiled,
            "last_loss": None if engine.last_loss is None else float(engine.last_loss),
            "scheduler_iterations": [
                getattr(c.scheduler, "last_batch_iteration", getattr(c.scheduler, "last_epoch", None))
                for c in trainer.lr_scheduler_configs
            ],
        }


def make_strategy(name: str) -> Any:
    """A registered name, or ``ZeroStrategy`` with a config when the name needs one here.

    zero2_offload: optimizer offload insists on ds_strategy's CPU optimizer kernels; the test module
    returns a torch Adam, so this run allows it (``zero_force_ds_cpu_optimizer: false``).
    zero3_sharded: stage 3 with every parameter partitioned (the test model's are all below the default
    persistence threshold, so plain zero3 keeps them gathered).
    zero3_nvme: zero3_sharded with the optimizer and the parameters offloaded to NVMe (swap files in /tmp).
    """
    import ds_strategy.lightning as zl

    if name == "zero3_sharded":
        return zl.ZeroStrategy(stage=3, config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    if name.endswith("_checkpointed"):  # every Linear recomputes its activations in backward (issue 20)
        return zl.ZeroStrategy(
            stage=int(name[4]),  # type: ignore[arg-type]
            config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
            activation_checkpointing_policy={nn.Linear},
        )

    if name == "zero3_nvme":  # both offloads in swap files under /tmp (issue 22)
        import tempfile

        return zl.ZeroStrategy(
            stage=3,
            offload_optimizer_device="nvme",
            offload_params_device="nvme",
            nvme_path=tempfile.gettempdir(),
            config={
                "zero_force_ds_cpu_optimizer": False,
                "zero_optimization": {
                    "stage3_param_persistence_threshold": 0,
                    "sub_group_size": 64,
                    "offload_param": {"max_in_cpu": 0},
                },
            },
        )
    if name.endswith("_offload"):
        stage = int(name[4])
        return zl.ZeroStrategy(
            stage=stage,  # type: ignore[arg-type]
            offload_optimizer=True,
            offload_parameters=stage == 3 or None,
            config={"zero_force_ds_cpu_optimizer": False},
        )
    return name


def quiet_trainer(strategy: Any, world_size: int, max_steps: int, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer on ``world_size`` processes for ``max_steps`` steps, without logger, checkpoints, progress
    bar or summary (what the tests comparing weights with one process need)."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def fit_run(
    rank: int,
    world_size: int,
    strategy: Any,
    trainer_kwargs: dict[str, Any],
    model_kwargs: dict[str, Any],
    seed: int = 0,
    then: tuple[str, ...] = (),
    features_dir: str | None = None,
    ckpt_path: str | None = None,
) -> dict[str, Any]:
    """Fit (then validate/test/predict as asked) on this rank; return what the tests compare."""
    saved_env = dict(os.environ)  # Lightning sets PL_GLOBAL_SEED etc.; the pooled worker outlives this run
    try:
        return _fit_run(strategy, world_size, trainer_kwargs, model_kwargs, seed, then, features_dir, ckpt_path)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _fit_run(
    strategy: Any,
    world_size: int,
    trainer_kwargs: dict[str, Any],
    model_kwargs: dict[str, Any],
    seed: int,
    then: tuple[str, ...],
    features_dir: str | None,
    ckpt_path: str | None,
) -> dict[str, Any]:
    import ds_strategy.lightning  # noqa: F401  - registers the names in this worker

    pl.seed_everything(seed, verbose=False)
    model = LitNet(**model_kwargs)
    lr_recorder, probe = LrRecorder(), EngineProbe()
    trainer_kwargs = dict(trainer_kwargs)
    callbacks = [lr_recorder, probe, *trainer_kwargs.pop("callbacks", [])]
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world_size,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **trainer_kwargs,
    }
    if features_dir is not None:
        # The callbacks users reach for, a logger (LearningRateMonitor needs one) and the progress bar.
        from lightning.pytorch.loggers import CSVLogger

        callbacks += [
            ModelCheckpoint(dirpath=os.path.join(features_dir, "ckpt"), monitor="val_loss", save_last=True),
            EarlyStopping(monitor="val_loss", patience=3),
            LearningRateMonitor(logging_interval="step"),
        ]
        kwargs.update(logger=CSVLogger(features_dir), enable_checkpointing=True, enable_progress_bar=True)
    trainer = pl.Trainer(
        strategy=make_strategy(strategy) if isinstance(strategy, str) else strategy, callbacks=callbacks, **kwargs
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    from ds_strategy.zero import GatheredParameters

    final_state = trainer.strategy.lightning_module_state_dict()  # stage 3: rank 0's, from the released shards
    with GatheredParameters(list(model.parameters())):  # stage 3: the shards the engine handed back
        weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    out: dict[str, Any] = {
        "losses": list(model.train_losses),
        "weights": weights,
        "final_state": {k: v.detach().float().clone() for k, v in final_state.items()},
        "lrs": lr_recorder.lrs,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "strategy": type(trainer.strategy).__name__,
        "stage": getattr(trainer.strategy, "stage", None),
        "world_size": trainer.world_size,
        "sampler": type(trainer.train_dataloader.sampler).__name__ if trainer.train_dataloader is not None else None,
        "built_in_configure_model": model.built_in_configure_model,
        "epochs": trainer.current_epoch,
        "pid": os.getpid(),
        "engine": probe.info,
        "callbacks": {type(c).__name__: _callback_state(c) for c in trainer.callbacks},
    }
    if features_dir is not None and trainer.is_global_zero:
        out["last_ckpt"] = read_lightning_checkpoint(os.path.join(features_dir, "ckpt", "last.ckpt"))
    if "validate" in then:
        out["validate"] = trainer.validate(model, verbose=False)
    if "test" in then:
        out["test"] = trainer.test(model, verbose=False)
    if "predict" in then:
        preds = trainer.predict(model)
        out["predict"] = torch.cat([p for p in preds if isinstance(p, torch.Tensor)]) if preds else None
    return out


def read_lightning_checkpoint(path: str) -> dict[str, Any]:
    """global_step and full weights of a Lightning checkpoint: a file (DDP) or a ZeroStrategy directory
    (consolidated from its shards)."""
    if os.path.isdir(path):
        from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict
        from ds_strategy.runtime.checkpoint.store import read_meta, resolve

        meta = read_meta(resolve(path, None))
        return {"global_step": meta["client_state"]["global_step"], "state_dict": consolidate_fp32_state_dict(path)}
    last = torch.load(path, weights_only=False)
    return {"global_step": last["global_step"], "state_dict": last["state_dict"]}


def _callback_state(callback: Callback) -> Any:
    if isinstance(callback, ModelCheckpoint):
        return {"best": callback.best_model_path, "last": callback.last_model_path}
    if isinstance(callback, EarlyStopping):
        return {"wait": callback.wait_count, "stopped_epoch": callback.stopped_epoch}
    if isinstance(callback, LearningRateMonitor):
        return {k: [float(v) for v in vals] for k, vals in callback.lrs.items()}
    return callback.state_dict() or None  # a test's own callback reports through its state_dict


def raises_run(
    rank: int,
    world_size: int,
    strategy: Any,
    trainer_kwargs: dict[str, Any],
    model_kwargs: dict[str, Any],
    **kwargs: Any,
) -> str:
    """Fit and return the error message (empty when it did not raise)."""
    try:
        fit_run(rank, world_size, strategy, trainer_kwargs, model_kwargs, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""
