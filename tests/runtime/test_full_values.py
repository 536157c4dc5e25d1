"""Every full-value accessor returns what one process holding the whole model holds (issue 42, criterion 1).

One model carries every kind of parameter: dense (``mid``), tied (``head.weight`` is ``embed.weight``), frozen
(``frozen``), a floating buffer (``offset``) and, in the MoE cases, an ``MoE`` layer of 4 experts whose expert
has trainable weights, a frozen parameter (``shift``) and a buffer (``scale``), each expert with its own
values. The matrix (``CASES``) crosses it with stages 0-3, expert parallelism (``ep_size`` 1, 2, 4; at world 4
the experts are also partitioned over their expert-data-parallel group), CPU and NVMe optimizer offload
(stage 3 also its parameters on NVMe) and ZeRO++ hpZ secondary partitions, where each is supported (MoE:
stages 0-2 without NVMe; hpZ: stage 3).

The reference is single-process torch: the ``ep_size`` 1 model holding every expert, each step averaging
the per-rank losses (each rank's tokens gated on their own, as the distributed run does), AdamW. After two
steps and a third boundary backward, and then after the third step, the body compares on every rank, for
every tensor (naming the accessor, key and rank on a mismatch):

- ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (exp_avg,
  exp_avg_sq) of every trainable parameter against torch's ``p.grad`` / weight / AdamW state; ``None`` for
  a frozen one;
- ``safe_get_local_*``: the fragments of the ranks of the parameter's own group (an expert's: its
  expert-data-parallel ranks), concatenated in rank order, are the flattened full value (stage 0: each
  rank's fragment is the whole value);
- ``GatheredParameters`` over every parameter of the module (an expert's local parameter against its
  global expert);
- ``engine.full_state_dict`` (every rank) and the file of ``save_16bit_model``: the whole single-process
  state dict, every expert under its global name;
- ``save_hf_weights``: the same (a tied weight once, as Hugging Face writes it);
- the consolidated fp32 checkpoint (``save_checkpoint`` + ``consolidate_fp32_state_dict``);
- ``engine.load_full_state_dict`` of the reference state dict moved by +0.5 (``full_state_dict`` and
  ``safe_get_full_fp32_param`` give it back), then ``load_checkpoint`` of the checkpoint written above and,
  after another move, ``load_hf_weights`` of the files written above: each brings back the reference
  (expert buffers and frozen expert parameters included, each expert its own).

Tolerances (fp32): rtol 2e-5, atol 2e-6 (bucketed reductions round in other places than torch).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed

D = 6
ROWS = 8  # rows (tokens) per rank per step
NUM_EXPERTS = 4
STEPS = 3
LR = 1e-2
TOL = {"rtol": 2e-5, "atol": 2e-6}
EXPERTS = "moe.deepspeed_moe.experts.deepspeed_experts."


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)
        self.shift = nn.Parameter(torch.zeros(D), requires_grad=False)  # a frozen expert parameter
        self.register_buffer("scale", torch.ones(D))  # an expert buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))) * self.scale + self.shift


class Net(nn.Module):
    def __init__(self, ep_size: int | None) -> None:
        super().__init__()
        from ds_strategy.moe import MoE

        self.embed = nn.Linear(D, D, bias=False)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.moe = (
            MoE(
                D,
                Expert(),
                num_experts=NUM_EXPERTS,
                ep_size=ep_size,
                capacity_factor=float(NUM_EXPERTS),  # every token fits
                min_capacity=1,
                use_rts=False,
                top2_2nd_expert_sampling=False,
            )
            if ep_size is not None
            else None
        )
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, D, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, D))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x)) + self.frozen(x)
        aux = h.new_zeros(())
        if self.moe is not None:
            h, l_aux, _ = self.moe(h)
            aux = 0.01 * l_aux
        h = torch.tanh(self.mid(h)) + self.offset
        return F.mse_loss(self.head(h), y) + aux


def full_model(moe: bool) -> Net:
    """The single-process model (every expert), each expert's frozen shift and buffer its own."""
    torch.manual_seed(0)
    model = Net(1 if moe else None)
    if model.moe is not None:
        with torch.no_grad():
            for e in model.moe.deepspeed_moe.experts.deepspeed_experts:
                e.shift.copy_(torch.randn(D) * 0.1)
                e.scale.copy_(1 + torch.randn(D) * 0.1)
    return model


def global_name(name: str, ep_size: int, ep_rank: int) -> str:
    """The single-process name of a rank's local state-dict key (test-side arithmetic, DeepSpeed's layout)."""
    if not name.startswith(EXPERTS):
        return name
    local, rest = name[len(EXPERTS) :].split(".", 1)
    return f"{EXPERTS}{ep_rank * (NUM_EXPERTS // ep_size) + int(local)}.{rest}"


def local_model(full: Net, ep_size: int, ep_rank: int) -> Net:
    model = Net(ep_size)
    src = full.state_dict()
    model.load_state_dict({k: src[global_name(k, ep_size, ep_rank)].clone() for k in model.state_dict()})
    return model


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(ROWS * world, D, generator=g), torch.randn(ROWS * world, D, generator=g)) for _ in range(STEPS)
    ]


# (label, world, stage, ep_size or None, extra zero_optimization keys)
CASES: list[tuple[str, int, int, int | None, dict[str, Any]]] = [
    ("dense", 2, 0, None, {}),
    ("dense", 2, 1, None, {}),
    ("dense", 2, 2, None, {}),
    ("dense", 2, 3, None, {}),
    ("offload", 2, 1, None, {"offload_optimizer": {"device": "cpu"}}),
    ("offload", 2, 2, None, {"offload_optimizer": {"device": "cpu"}}),
    ("offload", 2, 3, None, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    ("nvme", 2, 1, None, {"offload_optimizer": "nvme"}),
    ("nvme", 2, 2, None, {"offload_optimizer": "nvme"}),
    ("nvme", 2, 3, None, {"offload_optimizer": "nvme", "offload_param": "nvme"}),
    ("hpz", 4, 3, None, {"zero_hpz_partition_size": 2}),
    ("moe", 2, 2, 1, {}),
    ("moe", 2, 1, 2, {}),
    ("moe", 4, 0, 2, {}),
    ("moe", 4, 1, 2, {}),
    ("moe", 4, 2, 2, {}),
    ("moe-offload", 4, 1, 2, {"offload_optimizer": {"device": "cpu"}}),
    ("moe-offload", 4, 2, 2, {"offload_optimizer": {"device": "cpu"}}),
    ("moe", 4, 1, 4, {}),
    ("moe", 4, 2, 4, {}),
]


ON_RANK_0 = {"save_16bit_model", "save_hf_weights", "consolidated"}
ACCESSORS = ON_RANK_0 | {
    "safe_get_full_grad",
    "safe_get_full_fp32_param",
    "safe_get_full_optimizer_state[exp_avg]",
    "safe_get_full_optimizer_state[exp_avg_sq]",
    "safe_get_local_grad",
    "safe_get_local_fp32_param",
    "safe_get_local_optimizer_state[exp_avg]",
    "safe_get_local_optimizer_state[exp_avg_sq]",
    "GatheredParameters",
    "engine.full_state_dict",
    "load_full_state_dict,",
    "load_hf_weights,",
    "load_checkpoint,",
}


def _config(stage: int, extra: dict[str, Any], tmp: str) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": 40,  # parameters are cut across the ranks' shards
        "allgather_bucket_size": 40,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_force_ds_cpu_optimizer": False,
    }
    for key, value in extra.items():
        if value == "nvme":  # a swap directory of this run
            value = {"device": "nvme", "nvme_path": f"{tmp}/swap"}
            if key == "offload_param":
                value.update({"buffer_count": 2, "buffer_size": 400, "max_in_cpu": 0})
            config["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 2}
        zero[key] = value
    config["zero_optimization"] = zero
    return config


class Checks:
    """Collects mismatches (accessor, key, rank) instead of stopping at the first."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.counts: dict[str, int] = {}  # accessor -> tensors compared

    def close(self, what: str, key: str, got: Any, want: torch.Tensor) -> None:
        accessor = what.split(" ")[0]
        self.counts[accessor] = self.counts.get(accessor, 0) + 1
        if not isinstance(got, torch.Tensor):
            self.failures.append(f"{what} {key!r} on rank {self.rank}: got {type(got).__name__}")
            return
        got = got.detach().cpu()
        want = want.detach().cpu()
        if tuple(got.shape) != tuple(want.shape):
            self.failures.append(
                f"{what} {key!r} on rank {self.rank}: shape {list(got.shape)}, want {list(want.shape)}"
            )
            return
        if not torch.allclose(got.to(want.dtype), want, **TOL):
            off = float((got.to(want.dtype) - want).abs().max()) if want.is_floating_point() else -1.0
            self.failures.append(f"{what} {key!r} on rank {self.rank}: off by up to {off:.3g}")

    def state_dict(self, what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            self.failures.append(f"{what} on rank {self.rank}: missing keys {missing}, unexpected keys {extra}")
        for key in sorted(set(got) & set(want)):
            self.close(what, key, got[key], want[key])


def _body(rank: int, world: int, stage: int, ep_size: int | None, extra: dict[str, Any], tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    import ds_strategy
    from ds_strategy import utils
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict
    from ds_strategy.zero import GatheredParameters

    moe = ep_size is not None
    ep = ep_size or 1
    ep_rank = rank % ep  # expert-parallel groups are consecutive blocks of ep ranks
    edp_ranks = [rank % ep + k * ep for k in range(world // ep)]  # this rank's expert-data-parallel group
    full = full_model(moe)
    ref = copy.deepcopy(full)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    model = local_model(full, ep, ep_rank) if moe else copy.deepcopy(full)
    engine, *_ = ds_strategy.initialize(model=model, config=_config(stage, extra, tmp))
    dev = engine.device
    module = engine.module
    names = {id(p): n for n, p in module.named_parameters()}
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    params = [(n, p, ref_params[global_name(n, ep, ep_rank)]) for n, p in module.named_parameters()]
    check = Checks(rank)

    def group_of(name: str) -> list[int]:
        return edp_ranks if name.startswith(EXPERTS) else list(range(world))

    def locals_(what: str, getter: Any, want_of: Any) -> None:
        for name, p, rp in params:
            if not p.requires_grad:
                continue
            mine = getter(p).detach().cpu()
            pieces: list[Any] = [None] * world
            dist.all_gather_object(pieces, mine)
            want = want_of(rp).reshape(-1)
            if stage == 0:
                check.close(what + " (stage 0: the whole value)", name, mine, want)
            else:
                check.close(
                    what + " (fragments in rank order)", name, torch.cat([pieces[r] for r in group_of(name)]), want
                )

    def full_values(grads: bool) -> None:
        for name, p, rp in params:
            if not p.requires_grad:
                for getter in (utils.safe_get_full_fp32_param, utils.safe_get_local_fp32_param):
                    if getter(p) is not None:
                        check.failures.append(f"{getter.__name__} of frozen {name!r} on rank {rank} is not None")
                continue
            if grads:
                check.close("safe_get_full_grad", name, utils.safe_get_full_grad(p), rp.grad)
            else:
                check.close("safe_get_full_fp32_param", name, utils.safe_get_full_fp32_param(p), rp)
                for key in ("exp_avg", "exp_avg_sq"):
                    got = utils.safe_get_full_optimizer_state(p, key)
                    check.close(f"safe_get_full_optimizer_state[{key}]", name, got, ref_opt.state[rp][key])
        if grads:
            locals_("safe_get_local_grad", utils.safe_get_local_grad, lambda rp: rp.grad)
        else:
            locals_("safe_get_local_fp32_param", utils.safe_get_local_fp32_param, lambda rp: rp.detach())
            for key in ("exp_avg", "exp_avg_sq"):
                locals_(
                    f"safe_get_local_optimizer_state[{key}]",
                    lambda p, key=key: utils.safe_get_local_optimizer_state(p, key),
                    lambda rp, key=key: ref_opt.state[rp][key],
                )

    for step, (x, y) in enumerate(batches(world)):
        xs, ys = x.chunk(world), y.chunk(world)
        loss = engine(xs[rank].to(dev), ys[rank].to(dev))
        engine.backward(loss)
        ref_loss = sum(ref(a, b) for a, b in zip(xs, ys, strict=True)) / world
        ref_loss.backward()
        if step == STEPS - 1:
            full_values(grads=True)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
    full_values(grads=False)
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    with GatheredParameters([p for _, p, _ in params]):
        for name, p, rp in params:
            check.close("GatheredParameters", name, p.detach().float(), rp)

    check.state_dict("engine.full_state_dict", engine.full_state_dict(rank=None), want)
    out = Path(tmp)
    assert engine.save_16bit_model(str(out / "16bit"), "model.pt")
    hf_dir = out / "hf"
    utils.save_hf_weights(engine, hf_dir)
    engine.save_checkpoint(out / "ckpt", tag="t")
    if rank == 0:  # the files, read back by one process (no collective: a failure is recorded, not raised)
        from safetensors.torch import load_file

        files = {
            "save_16bit_model": (lambda: torch.load(out / "16bit" / "model.pt", weights_only=True), want),
            "save_hf_weights": (  # a tied weight once, under its first name
                lambda: load_file(str(hf_dir / "model.safetensors")),
                {k: v for k, v in want.items() if k != "head.weight"},
            ),
            "consolidated fp32 checkpoint": (lambda: consolidate_fp32_state_dict(out / "ckpt", "t"), want),
        }
        for what, (read, expected) in files.items():
            try:
                got = read()
            except Exception as err:  # reported with the other mismatches
                check.failures.append(f"{what}: reading it back raised {type(err).__name__}: {err}")
                continue
            check.state_dict(what, got, expected)
    dist.barrier()

    moved = {k: v + 0.5 if v.is_floating_point() else v for k, v in want.items()}
    engine.load_full_state_dict(moved)
    check.state_dict("load_full_state_dict, then full_state_dict", engine.full_state_dict(rank=None), moved)
    for name, p, _ in params:
        if p.requires_grad:
            got = utils.safe_get_full_fp32_param(p)
            check.close(
                "load_full_state_dict, then safe_get_full_fp32_param", name, got, moved[global_name(name, ep, ep_rank)]
            )
    engine.load_checkpoint(out / "ckpt", tag="t", load_optimizer_states=False)  # expert entries: their files
    check.state_dict("load_checkpoint, then full_state_dict", engine.full_state_dict(rank=None), want)
    engine.load_full_state_dict(moved)
    utils.load_hf_weights(engine, hf_dir)
    check.state_dict("load_hf_weights, then full_state_dict", engine.full_state_dict(rank=None), want)
    engine.destroy()
    assert names  # every parameter had a name
    return {"failures": check.failures, "counts": check.counts}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("label", "world", "stage", "ep_size", "extra"), CASES, ids=[f"{c[0]}-w{c[1]}-s{c[2]}-ep{c[3]}" for c in CASES]
)
def test_full_values_equal_the_single_process_model(
    tmp_path: Path, label: str, world: int, stage: int, ep_size: int | None, extra: dict[str, Any]
) -> None:
    (tmp_path / "swap").mkdir()  # NVMe offload's swap directory
    results = run_distributed(_body, world_size=world, args=(stage, ep_size, extra, str(tmp_path)), timeout=300)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])
    # every accessor compared something (rank 0 also read the files)
    assert set(results[0]["counts"]) == ACCESSORS, results[0]["counts"]
    assert all(set(r["counts"]) == ACCESSORS - ON_RANK_0 for r in results[1:])
