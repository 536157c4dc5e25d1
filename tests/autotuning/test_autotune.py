"""``ds_strategy.autotune`` end to end on CPU ranks (issue 44, criteria 1, 2, 4, 5): in-process trials with
the global batch held, a memory cap below the DDP footprint, memory returned between trials, failures agreed
by every rank without a hang, and the files a tune leaves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from tests.autotuning.models import Net
from tests.harness import run_distributed

MIB = 1 << 20


def _config(tmp: str, **tuning: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 1,
            "end_profile_step": 3,
            "tuner_type": "gridsearch",
            "num_tuning_micro_batch_sizes": 2,
            "tuner_early_stopping": 100,
            "results_dir": f"{tmp}/results",
            "exps_dir": f"{tmp}/exps",
            **tuning,
        },
    }


def _data() -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(1))


def _tune_under_cap(rank: int, world: int, tmp: str, cap: int) -> dict[str, Any]:
    from ds_strategy.autotuning import SearchSpace, autotune
    from ds_strategy.autotuning.trial import run_trial

    space = SearchSpace(stages=(0, 2, 3), offload_optimizer=("none",), activation_checkpointing=(False,))
    result = autotune(Net, _data(), _config(tmp, max_memory_per_rank=cap), space=space, verbose=rank == 0)
    assert result.best is not None
    # The winner, run fresh (a new engine after the tune's teardown), stays under the cap.
    setup = _setup(result, cap)
    again = run_trial(setup, result.best.candidate)
    return {
        "best": result.best.candidate.knobs(),
        "best_peak": result.best.peak_bytes,
        "again": (again.status, again.peak_bytes),
        "statuses": {t.candidate.name: (t.status, t.peak_bytes, t.predicted_bytes) for t in result.trials},
        "batches": sorted({t.candidate.micro_batch * t.candidate.accumulation * world for t in result.trials}),
    }


def _setup(result: Any, cap: int | None) -> Any:
    import torch.distributed as dist

    from ds_strategy.autotuning.data import batch_fn_of, default_loss
    from ds_strategy.autotuning.trial import TrialSetup

    return TrialSetup(
        model_fn=Net,
        batch_fn=batch_fn_of(_data(), dist.get_rank(), dist.get_world_size()),
        loss_fn=default_loss,
        optimizer=None,
        base_config={"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        device=torch.device("cpu"),
        world_size=dist.get_world_size(),
        start_step=1,
        end_step=3,
        cap_bytes=cap,
        train_flops_per_sample=result.profile.train_flops_per_sample if result is not None else 0.0,
        peak_flops_per_device=None,
    )


def test_a_cap_below_the_ddp_footprint_picks_a_configuration_that_fits(tmp_path: Path) -> None:
    # Measured over a trial's start on 2 CPU ranks: DDP (stage 0) ~77 MiB (67 MB of model states), stage 1 ~68,
    # stage 2 ~75, stage 3 ~60-66 (gloo's reduce-scatter and all-gather go through full-bucket all-reduces
    # on the CPU). Stage 1 is left out of the space: it sits too close to any cap between stages 2 and 3.
    cap = 72 * MIB
    out = run_distributed(_tune_under_cap, world_size=2, args=(str(tmp_path), cap), timeout=600)
    for r in out:
        assert r == out[0]  # every rank reached the same verdicts
    r = out[0]
    assert r["batches"] == [8]  # every candidate held the global batch
    assert r["best"]["stage"] == 3, r
    assert r["best_peak"] <= cap and r["again"][0] == "ok" and r["again"][1] <= cap, r
    stage0 = [v for k, v in r["statuses"].items() if k.startswith("z0_")]
    assert stage0 and all(status != "ok" for status, _, _ in stage0), r["statuses"]  # DDP does not fit
    files = {p.name for p in (tmp_path / "results").iterdir()}
    assert {"trials.json", "ds_config.json", "best.json", "autotune.png"} <= files
    written = json.loads((tmp_path / "results" / "ds_config.json").read_text())
    assert written["zero_optimization"]["stage"] == r["best"]["stage"] and "autotuning" not in written
    assert len(list((tmp_path / "exps").glob("*.json"))) >= 2


def _memory_returned(rank: int, world: int) -> dict[str, Any]:
    from ds_strategy.autotuning import Candidate
    from ds_strategy.autotuning.trial import run_trial

    setup = _setup(None, None)
    small = Candidate(stage=3, micro_batch=2, accumulation=2)
    big = Candidate(stage=0, micro_batch=4, accumulation=1)
    first = run_trial(setup, small)
    run_trial(setup, big)
    after = run_trial(setup, small)
    return {"first": first.peak_bytes, "after": after.peak_bytes, "ok": (first.status, after.status)}


def test_a_trials_peak_does_not_include_the_previous_trials_buffers() -> None:
    for r in run_distributed(_memory_returned, world_size=2, timeout=300):
        assert r["ok"] == ("ok", "ok")
        assert r["after"] <= r["first"] * 1.15 + 4 * MIB, r


class _OutOfMemoryOnRank1(nn.Module):
    """Raises torch.OutOfMemoryError in the forward of rank 1 only, at micro batch 4: the peers are then
    already inside the step's collectives (backward), the case that hangs DeepSpeed's autotuner."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net(width=64, depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if x.shape[0] == 4 and dist.get_rank() == 1:
            raise self.error
        return self.net(x)

    error: Exception = torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")


class _ErrorOnRank1(_OutOfMemoryOnRank1):
    error = ValueError("simulated: a shape the model cannot take")


def _failures(rank: int, world: int, tmp: str, model: type[nn.Module] = _OutOfMemoryOnRank1) -> dict[str, Any]:
    from ds_strategy.autotuning import SearchSpace, autotune

    space = SearchSpace(stages=(2,), offload_optimizer=("none",), activation_checkpointing=(False,))
    data = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    result = autotune(
        model, data, _config(tmp, num_tuning_micro_batch_sizes=3), space=space, trial_timeout_s=3, verbose=False
    )
    return {t.candidate.micro_batch: t.status for t in result.trials} | {"best": result.best.candidate.micro_batch}


def test_an_out_of_memory_on_one_rank_is_agreed_by_every_rank_and_the_search_goes_on(tmp_path: Path) -> None:
    out = run_distributed(_failures, world_size=2, args=(str(tmp_path),), timeout=300)
    assert out[0] == out[1]
    assert out[0][4] == "out of memory", out  # rank 0 timed out in its collective; rank 1's verdict wins
    assert out[0][1] == "ok" and out[0][2] == "ok" and out[0]["best"] in (1, 2)


def test_a_trial_records_the_failing_ranks_error_not_its_peers_timeout(tmp_path: Path) -> None:
    out = run_distributed(_failures, world_size=2, args=(str(tmp_path), _ErrorOnRank1), timeout=300)
    assert out[0] == out[1]
    assert out[0][4] == "rank 1: error: ValueError: simulated: a shape the model cannot take", out


def _bad_batches(rank: int, world: int, tmp: str) -> list[str]:
    from ds_strategy.autotuning import autotune

    messages = []
    for tuning in ({"min_train_micro_batch_size_per_gpu": 16, "max_train_micro_batch_size_per_gpu": 32},
                   {"max_train_batch_size": 4}):  # fmt: skip
        with pytest.raises(ValueError) as err:
            autotune(Net, _data(), _config(tmp, **tuning), verbose=False)
        messages.append(str(err.value))
    return messages


def test_bad_batches_name_the_keys(tmp_path: Path) -> None:
    small, over = run_distributed(_bad_batches, world_size=2, args=(str(tmp_path),), timeout=120)[0]
    assert "min_train_micro_batch_size_per_gpu=16" in small and "per-rank batch 4" in small
    assert "max_train_batch_size is 4" in over and "global batch is 8" in over


def _sequence_parallel(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from ds_strategy.autotuning import SearchSpace, autotune
    from ds_strategy.runtime import initialize

    config = {**_config(tmp, num_tuning_micro_batch_sizes=3), "train_batch_size": 4, "sequence_parallel_size": 2}
    space = SearchSpace(stages=(1,), offload_optimizer=("none",), activation_checkpointing=(False,))
    result = autotune(Net, _data(), config, space=space, verbose=False)
    engine, *_ = initialize(model=Net(), config=result.best_config)  # the winner trains as it is
    batch = engine.train_batch_size()
    engine.destroy()
    return {
        "statuses": sorted({t.status for t in result.trials}),
        "splits": sorted((t.candidate.micro_batch, t.candidate.accumulation) for t in result.trials),
        "batch": batch,
    }


def test_sequence_parallel_ranks_share_the_batch(tmp_path: Path) -> None:
    """2 ranks in one sequence-parallel group are one data-parallel replica: the global batch 4 is each
    rank's (not 2 per rank), the candidates split 4, every trial runs and the winner's config initializes."""
    out = run_distributed(_sequence_parallel, world_size=2, args=(str(tmp_path),), timeout=300)
    for r in out:
        assert r["statuses"] == ["ok"] and r["batch"] == 4, r
        assert r["splits"] == [(1, 4), (2, 2), (4, 1)], r["splits"]


class _SequenceLengths(nn.Module):
    """A token model that records the sequence length each forward sees (trials run with grad enabled)."""

    seen: ClassVar[list[int]] = []

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, input_ids: torch.Tensor, **rest: Any) -> torch.Tensor:
        if torch.is_grad_enabled():
            type(self).seen.append(int(input_ids.shape[1]))
        return self.head(self.embed(input_ids)).float().pow(2).mean()


def _sequence_shards(rank: int, world: int, tmp: str) -> list[int]:
    from ds_strategy.autotuning import SearchSpace, autotune

    ids = torch.randint(0, 32, (16, 12), generator=torch.Generator().manual_seed(3))
    config = {**_config(tmp, num_tuning_micro_batch_sizes=1), "train_batch_size": 2, "sequence_parallel_size": 2}
    space = SearchSpace(stages=(1,), offload_optimizer=("none",), activation_checkpointing=(False,))
    _SequenceLengths.seen.clear()
    autotune(_SequenceLengths, lambda micro, step: {"input_ids": ids[:micro]}, config, space=space, verbose=False)
    return list(_SequenceLengths.seen)


def test_sequence_parallel_trials_feed_each_rank_its_slice_of_the_sequence(tmp_path: Path) -> None:
    """As in training (ZeroStrategy shards a batch with input_ids), a trial's forward sees 12 / 2 tokens."""
    for seen in run_distributed(_sequence_shards, world_size=2, args=(str(tmp_path),), timeout=300):
        trial_forwards = seen[-3:]  # end_profile_step 3, one micro batch each; the profile's come first
        assert trial_forwards == [6, 6, 6], seen
