"""A successful 2-process job whose ranks reach interpreter exit at different times (issue 18's clean-exit
case); the script does nothing special at its end (no barrier, no destroy_process_group) unless KIND says so.

    python -m torch.distributed.run --nproc_per_node 2 uneven_exit.py

KIND picks what runs: engine (STAGE, PREC, OFFLOAD as below), usergroup (the same on a group the script
made with init_process_group and, as torch asks of the creator, destroys at its end: ds_strategy never
destroys a group it did not create), selfdestroy (an engine run on init_distributed's group that calls
destroy_process_group() at its end),
checkpoint (an engine run that saves a sharded checkpoint), lightning (a Trainer fit with strategy
zero2/zero3 under torchrun), moe (an MoE model with ep_size 2: the expert groups ds_strategy creates),
pipeline (a 2-stage PipelineModule with a tied layer: stage, tie and control groups, and its p2p waiter).
LATE picks the rank that keeps working for about SECONDS after training (as
a script that evaluates or reports on one rank does); every launch must exit 0 on every rank.

The deterministic half of the check: the atexit handler registered here, first, runs last, after
ds_strategy's. By then the group must be destroyed for real, its gloo threads joined while the interpreter
was whole; a thread still alive would be torn down in finalisation (the rare abort). It exits 3 if any is.
"""

import atexit
import os
import sys
import tempfile
import time


def _gloo_threads_left() -> None:
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    alive = sorted(n for n in names if "gloo" in n)
    if alive:
        print(f"gloo threads alive after ds_strategy's exit handler: {alive}", file=sys.stderr, flush=True)
        os._exit(3)


atexit.register(_gloo_threads_left)

import torch  # noqa: E402  (after the handler above, so that it runs last)

KIND = os.environ.get("KIND", "engine")
STAGE = int(os.environ.get("STAGE", "1"))
PREC = os.environ.get("PREC", "bf16")
OFFLOAD = os.environ.get("OFFLOAD", "cpu")
LATE = int(os.environ.get("LATE", "0"))
SECONDS = float(os.environ.get("SECONDS_LATE", "1.5"))


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    )


def config() -> dict:
    zero: dict = {"stage": STAGE}
    if OFFLOAD == "cpu" and STAGE > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
        if STAGE == 3:
            zero["offload_param"] = {"device": "cpu"}
    if STAGE == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "bf16": {"enabled": PREC == "bf16"},
    }


def engine_run() -> int:
    import torch.distributed as dist

    import ds_strategy

    if KIND == "usergroup":  # the script makes the group itself (and destroys it below)
        dist.init_process_group("gloo")
    else:
        ds_strategy.init_distributed()
    model = net()
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=config())
    for _ in range(6):
        loss = engine(torch.randn(4, 16)).float().square().mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)  # the script's own logging collective on the default group
    if KIND == "checkpoint":
        root = os.environ.get("CKPT_DIR") or tempfile.mkdtemp(prefix="uneven_exit_")
        engine.save_checkpoint(root, tag="last")
    rank = dist.get_rank()
    if KIND in ("selfdestroy", "usergroup"):  # the script tears its group down itself (torch.optim's lazy
        dist.destroy_process_group()  # imports may still hold it: the package releases exactly that holder)
    return rank


def moe_run() -> int:
    import torch.distributed as dist

    import ds_strategy
    from ds_strategy.moe import MoE

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            expert = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            self.moe = MoE(16, expert, num_experts=4, ep_size=2, k=1, capacity_factor=4.0, min_capacity=1)
            self.head = torch.nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, l_aux, _ = self.moe(x)
            return self.head(h).float().square().mean() + 0.01 * l_aux

    ds_strategy.init_distributed()
    torch.manual_seed(0)
    model = Net()
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=config())
    for _ in range(4):
        engine.backward(engine(torch.randn(4, 3, 16)))
        engine.step()
    return dist.get_rank()


def pipeline_run() -> int:
    import torch.distributed as dist

    import ds_strategy
    from ds_strategy.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    ds_strategy.init_distributed()
    layers = [
        TiedLayerSpec("proj", torch.nn.Linear, 16, 16, bias=False),
        LayerSpec(torch.nn.Linear, 16, 32),
        torch.nn.Tanh(),
        LayerSpec(torch.nn.Linear, 32, 16),
        TiedLayerSpec("proj", torch.nn.Linear, 16, 16, bias=False),
    ]
    module = PipelineModule(layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {**config(), "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    engine, *_ = ds_strategy.initialize(model=module, config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        engine.train_batch(iter([(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))] * 2))
    return dist.get_rank()


def lightning_run() -> int:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import ds_strategy  # noqa: F401  (registers the "zero2" / "zero3" strategy names)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=f"zero{max(STAGE, 2)}",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Lit(), DataLoader(data, batch_size=4))
    return trainer.global_rank


def main() -> None:
    runs = {"lightning": lightning_run, "moe": moe_run, "pipeline": pipeline_run}
    rank = runs.get(KIND, engine_run)()
    if rank == LATE:  # extra work on one rank only: a reference computation, a report
        ref = torch.nn.Sequential(torch.nn.Embedding(97, 64), torch.nn.Linear(64, 97))
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        end = time.time() + SECONDS
        while time.time() < end:
            ids = torch.randint(0, 97, (8, 12))
            loss = torch.nn.functional.cross_entropy(ref(ids).reshape(-1, 97), ids.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    print(f"rank {rank} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
