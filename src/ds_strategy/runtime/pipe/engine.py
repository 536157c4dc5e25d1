"""``PipelineEngine``: pipeline-parallel training of a ``PipelineModule``, with data parallelism and ZeRO-1.

    engine, _, _, _ = ds_strategy.initialize(model=pipeline_module, config=cfg)   # a PipelineEngine
    loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro-batches, one optimizer step

Each rank holds one stage. The stage's parameters are trained by an ordinary ``ZeroEngine`` over the
rank's data-parallel group (stage 0 or 1, as DeepSpeed allows with pipelines), so the flat partition,
precision, loss scaling, optimizers, schedulers and full-state access are the engine's. The pipeline adds:
the 1F1B schedule (``schedule.py``), the point-to-point link (``p2p.py``), the tied-weight gradient sum,
and a gradient norm taken over every stage (the ZeroEngine's ``grad_norm_fn``), so clipping and fp16
overflow skips agree across the whole model.

[Note: a failing stage]
A stage that raises posts "stage s (rank r) raised ..." in the default group's store; a rank blocked in
a receive watches for that notice and stops. Every ``train_batch`` / ``eval_batch`` ends with one
all-gather of per-rank failure codes on an auxiliary gloo group, so every rank learns whether any stage
failed and raises ``PipelineStageError`` naming it; none waits for a message that will not come. The
gradients are reduced across data-parallel ranks only after that agreement (never inside the backward),
so no rank is left inside a collective with a failed peer.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ds_strategy.comm.ownership import GroupSet
from ds_strategy.comm.shm_channel import same_host_peers

from ..engine import ZeroEngine
from ..zero.access import find
from ..zero.grad_norm import grad_norm
from .module import PipelineModule
from .p2p import Link, PeerFailed, PipelineStageError
from .schedule import eval_schedule, link_depth, train_schedule


def _as_list(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return list(x)
    raise TypeError(f"a pipeline stage must take and return a tensor or a tuple of tensors, got {type(x).__name__}")


def _float_requires_grad(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_float_requires_grad(t) for t in x)
    return x


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(t, device) for t in x)
    return x


class PipelineEngine:
    """Trains the stage of ``module`` this rank holds; see the module docstring."""

    def __init__(self, module: PipelineModule, engine: ZeroEngine) -> None:
        if engine.zero_optimization_stage() > 1:
            raise ValueError(
                f"zero_optimization.stage={engine.zero_optimization_stage()} cannot be combined with pipeline "
                "parallelism (as in DeepSpeed); valid: 0 or 1"
            )
        self.module = module
        self.engine = engine
        engine.grad_norm_fn = self._grad_norm
        groups = module.groups
        self.stage_id = module.stage_id
        self.num_stages = module.num_stages
        self.global_rank = dist.get_rank()
        self.prev_rank = groups.pipe_ranks[self.stage_id - 1] if self.stage_id > 0 else None
        self.next_rank = groups.pipe_ranks[self.stage_id + 1] if self.stage_id < self.num_stages - 1 else None
        self.micro_batches = engine.gradient_accumulation_steps()
        self.device = engine.device
        self._owned = GroupSet(self, attributes=("control",))  # destroyed by destroy() and at exit
        self.control = self._owned.new_group(backend="gloo")  # failure flags: a gloo group whatever the default backend
        box = [uuid.uuid4().hex if self.global_rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        self._uid = str(box[0])
        self._calls = 0
        # Neighbours on this host get shared-memory channels (collective: every rank asks).
        near = same_host_peers([self.prev_rank, self.next_rank], group=self.control)
        store = dist.distributed_c10d._get_default_store()
        self.link = Link(self.device, store, shm_peers=near, channel_prefix=f"ds_pipe/{self._uid}/channel")
        self.training_dataloader: Any = None
        self._data_iter: Iterator[Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.timing: dict[str, float] = {}

    # ------------------------------------------------------------------ DeepSpeed's pipeline API
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self._data_iter = iterator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a PipelineEngine runs whole batches: call engine.train_batch() or engine.eval_batch()")

    backward = step = __call__ = forward

    def train_batch(self, data_iter: Iterable[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches (1F1B); returns the mean
        loss of the batch on every rank. The first and the last stage each draw every micro-batch from
        their ``data_iter`` as ``(inputs, labels)``; other stages may pass None."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients: call it outside torch.no_grad()")
        it = self._iterator(data_iter)
        self.module.train()
        start = time.perf_counter()
        self._size_channels(self.micro_batches)
        losses = self._guarded(lambda: self._run_train(it))
        run_s = time.perf_counter() - start
        self.engine.set_gradient_accumulation_boundary(True)
        try:
            self.engine.step()
        finally:
            self.engine.set_gradient_accumulation_boundary(None)
        self.engine.micro_steps += self.micro_batches - 1
        loss = self._aggregate(losses, self.micro_batches, reduce_output="avg")
        self.timing = dict(self.timing, schedule_s=run_s, batch_s=time.perf_counter() - start)
        self.agg_train_loss = loss
        return loss

    def eval_batch(
        self,
        data_iter: Iterable[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward ``num_micro_batches`` (default gradient_accumulation_steps) micro-batches without
        gradients; return the loss (``reduce_output="avg"``: the mean, None: one per micro-batch), averaged
        over data-parallel ranks and, with ``bcast_loss``, given to every stage. ``return_logits``: also
        return the last stage's outputs, one per micro-batch (None on other stages)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output={reduce_output!r}; valid: 'avg' or None")
        m = num_micro_batches or self.micro_batches
        it = self._iterator(data_iter)
        was_training = self.module.training
        self.module.eval()
        try:
            self._size_channels(m)
            with torch.no_grad():
                outputs = self._guarded(lambda: self._run_eval(it, m, compute_loss))
        finally:
            self.module.train(was_training)
        losses = [o for o, _ in outputs] if compute_loss else []
        loss = self._aggregate(losses, m, reduce_output=reduce_output, bcast=bcast_loss) if compute_loss else None
        if return_logits:
            return loss, ([logits for _, logits in outputs] if self.is_last_stage() else None)
        return loss

    # ------------------------------------------------------------------ the schedules
    def _size_channels(self, m: int) -> None:
        """Slots per tensor of a channel made during this call: the link's 1F1B depth (``link_depth``)."""
        p, s = self.num_stages, self.stage_id
        self.link.capacity = {
            peer: link_depth(m, p, lower)
            for peer, lower in ((self.next_rank, s), (self.prev_rank, s - 1))
            if peer is not None
        }

    def _iterator(self, data_iter: Iterable[Any] | None) -> Iterator[Any] | None:
        if data_iter is not None:
            return data_iter if isinstance(data_iter, Iterator) else iter(data_iter)
        if self._data_iter is None and self.training_dataloader is not None:
            self._data_iter = _repeat(self.training_dataloader)
        if self._data_iter is None and (self.is_first_stage() or self.is_last_stage()):
            raise ValueError(f"stage {self.stage_id} needs data: pass data_iter= or initialize(training_data=...)")
        return self._data_iter

    def _load(self, it: Iterator[Any] | None) -> tuple[Any, Any]:
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        assert it is not None
        batch = next(it)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                f"pipeline data must yield (inputs, labels) pairs, got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        return _to(batch[0], self.device), _to(batch[1], self.device)

    def _stage_input(self, inputs: Any, mode: str) -> tuple[Any, list[torch.Tensor]]:
        if self.is_first_stage():
            if mode == "train" and self.module.activation_checkpoint_interval > 0:
                # As DeepSpeed: a reentrant checkpoint around the first layers needs an input that requires
                # grad, or the parameters inside it get no gradient.
                inputs = _float_requires_grad(inputs)
            return inputs, []
        assert self.prev_rank is not None
        key = ("act", self.prev_rank, mode)
        received = self.link.recv(self.prev_rank, key)
        if mode == "train":
            for t, grad in zip(received, self.link.requires_grad(key), strict=True):
                t.requires_grad_(grad and t.is_floating_point())
        return (received[0] if len(received) == 1 else tuple(received)), received

    def _forward(self, it: Iterator[Any] | None, mode: str) -> tuple[Any, list[torch.Tensor], Any]:
        inputs, labels = self._load(it)
        x, received = self._stage_input(inputs, mode)
        t0 = time.perf_counter()
        out = self.engine(x)
        self.timing["busy_s"] += time.perf_counter() - t0
        if not self.is_last_stage():
            assert self.next_rank is not None
            self.link.send(_as_list(out), self.next_rank, ("act", self.global_rank, mode))
        return out, received, labels

    def _loss(self, out: Any, labels: Any) -> torch.Tensor:
        loss_fn = self.module.loss_fn
        loss = loss_fn(out, labels) if loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "the last stage must produce a scalar loss: give PipelineModule(loss_fn=...) or end the layers "
                f"with one (got {type(loss).__name__}{tuple(getattr(loss, 'shape', ()))})"
            )
        return loss

    def _run_train(self, it: Iterator[Any] | None) -> list[torch.Tensor]:
        m = self.micro_batches
        self.timing = {"busy_s": 0.0}
        live: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        losses: list[torch.Tensor] = []
        stage = self.engine.stage
        for kind, i in train_schedule(m, self.num_stages, self.stage_id):
            if kind == "forward":
                out, received, labels = self._forward(it, "train")
                if self.is_last_stage():
                    t0 = time.perf_counter()
                    out = self._loss(out, labels)
                    self.timing["busy_s"] += time.perf_counter() - t0
                    losses.append(out.detach().float())
                live[i] = (out, received)
                continue
            out, received = live.pop(i)
            if self.is_last_stage():
                scale = self.engine.loss_scaler.loss_scale / m
                targets, grads = [out.float() * scale], None
            else:
                assert self.next_rank is not None
                grads = self.link.recv(self.next_rank, ("grad", self.next_rank, "train"))
                outs = _as_list(out)
                targets = [t for t in outs if t.requires_grad]
                if len(targets) != len(grads):
                    raise RuntimeError(
                        f"stage {self.stage_id}: {len(grads)} gradients came back for {len(targets)} outputs "
                        "that require grad"
                    )
            t0 = time.perf_counter()
            stage.begin_backward(reduce=False)  # reduced after the batch's agreement: see the module docstring
            try:
                torch.autograd.backward(targets, grads)
            finally:
                stage.end_backward()
            self.timing["busy_s"] += time.perf_counter() - t0
            if not self.is_first_stage():
                assert self.prev_rank is not None
                back = [t.grad if t.grad is not None else torch.zeros_like(t) for t in received if t.requires_grad]
                self.link.send(back, self.prev_rank, ("grad", self.global_rank, "train"))
        return losses

    def _run_eval(self, it: Iterator[Any] | None, m: int, compute_loss: bool) -> list[tuple[Any, Any]]:
        self.timing = {"busy_s": 0.0}
        results = []
        for _, _ in eval_schedule(m):
            out, _, labels = self._forward(it, "eval")
            if self.is_last_stage():
                loss = self._loss(out, labels).detach().float() if compute_loss else None
                results.append((loss, out))
            else:
                results.append((None, None))
        return results

    # ------------------------------------------------------------------ failures: see [Note: a failing stage]
    def _guarded(self, fn: Callable[[], Any]) -> Any:
        self._calls += 1
        self.link.prefix = f"ds_pipe/{self._uid}/{self._calls}"
        code: int = 0
        cause: Exception | None = None
        result = None
        try:
            result = fn()
            self.link.drain()
        except PeerFailed as e:
            code, cause = 2, e
        except Exception as e:
            code, cause = 1, e
            self.link.post_failure(
                self.global_rank, f"stage {self.stage_id} (rank {self.global_rank}) raised {type(e).__name__}: {e}"
            )
        # An object collective on the gloo control group: host bytes, which gloo takes whatever the default
        # backend (the device-strict mode, which cannot tell a gloo group from an NCCL one, exempts it too).
        codes: list[Any] = [None] * dist.get_world_size(self.control)
        dist.all_gather_object(codes, code, group=self.control)
        if any(codes):
            origins = [r for r, c in enumerate(codes) if c == 1]
            told = "; ".join(self.link.failure_message(r) for r in origins)
            raise PipelineStageError(
                f"pipeline {told} - every rank stops (this is rank {self.global_rank}, stage {self.stage_id})"
            ) from cause
        return result

    # ------------------------------------------------------------------ reductions across stages
    def _aggregate(self, losses: list[Any], n: int, *, reduce_output: str | None, bcast: bool = True) -> Any:
        """The last stage's ``n`` losses (one per micro-batch, every stage ran ``n``), averaged over its
        data-parallel group, then sent to every stage. Device tensors only (NCCL takes nothing else)."""
        groups = self.module.groups
        assert not self.is_last_stage() or len(losses) == n, (len(losses), n)
        values = torch.stack(losses).to(self.device) if self.is_last_stage() else torch.zeros(n, device=self.device)
        if self.is_last_stage() and groups.data_group is not None and len(groups.data_ranks) > 1:
            dist.all_reduce(values, group=groups.data_group)
            values /= len(groups.data_ranks)
        if bcast and groups.pipe_group is not None and self.num_stages > 1:
            dist.broadcast(values, src=groups.pipe_ranks[-1], group=groups.pipe_group)
        elif not self.is_last_stage():
            return None
        return values.mean() if reduce_output == "avg" else values

    def _tied_sum(self) -> torch.Tensor:
        """Sum the tied weights' gradients in each tie group; return the squared norm (in stored, scaled
        units; a 0-dim fp64 device tensor, never read on the host) of the copies that do not count in the
        global norm (all but the first stage's)."""
        extra = torch.zeros((), dtype=torch.float64, device=self.device)
        for key, comm in self.module.tied_comms.items():
            for p in self.module.tied_parameters(key):
                found = find(p)
                if found is None:
                    continue
                access, g, i = found
                full = access.get_full(g, i, "grad")  # on the stage's compute device, offloaded or not
                dist.all_reduce(full, group=comm["group"])
                access.set_full(g, i, full, "grad")
                if self.global_rank != min(comm["ranks"]):
                    extra += full.double().pow(2).sum() / access.grad_factor() ** 2
        return extra

    def _grad_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm, overflow) over every stage, as the stage's own ``grad_norm``: 0-dim device tensors (fp64
        norm, fp32 flag), so the step decides clipping and skipping on the device without a host read."""
        extra = self._tied_sum()
        raw, overflow = grad_norm(self.engine.stage)
        raw = raw.to(self.device, torch.float64)
        sq = torch.where(torch.isfinite(raw), raw * raw - extra, torch.full_like(raw, math.inf))
        both = torch.stack([sq, overflow.to(self.device, torch.float64)])
        groups = self.module.groups
        if groups.pipe_group is not None and self.num_stages > 1:
            dist.all_reduce(both, group=groups.pipe_group)
        sq, inf = both[0], both[1]
        finite = torch.isfinite(sq)
        norm = torch.where(finite, sq.clamp(min=0).sqrt(), torch.full_like(sq, math.inf))
        return norm, ((inf > 0) | ~finite).float()

    # ------------------------------------------------------------------ checkpoints (checkpoint.py)
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Write ``save_dir/<tag>``: one file per rank with its shards (every rank calls it; no tensor crosses
        ranks), published atomically; ``latest`` is rewritten when ``save_latest``. See checkpoint.py."""
        from .checkpoint import save_pipe_checkpoint

        if exclude_frozen_parameters:
            raise NotImplementedError(
                "PipelineEngine.save_checkpoint(exclude_frozen_parameters=True): pipeline checkpoints hold every "
                "layer's parameters (frozen ones included); save without it, or train with ZeroEngine to leave "
                "frozen parameters out"
            )

        return str(save_pipe_checkpoint(self, save_dir, tag, client_state, save_latest=save_latest))

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """Load a pipeline checkpoint written at any depth / data-parallel degree; (tag dir, client state).
        DeepSpeed's signature: ``load_module_strict`` is accepted (every layer's entries are checked);
        ``custom_load_fn`` must be None."""
        from ..checkpoint.load import refuse_custom_load_fn
        from .checkpoint import load_pipe_checkpoint

        refuse_custom_load_fn(custom_load_fn)
        del load_module_strict

        return load_pipe_checkpoint(
            self,
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    # ------------------------------------------------------------------ the rest is the stage's engine
    def destroy(self, *, release_params: bool = True) -> None:
        """Unmap the shared-memory channels, then release the stage engine's resources (``ZeroEngine.destroy``)
        and destroy the control group this engine created."""
        self.link.close()
        self.engine.destroy(release_params=release_params)
        self._owned.destroy()

    def __getattr__(self, name: str) -> Any:
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)


def _repeat(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        yield from loader
