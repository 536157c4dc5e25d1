"""The search space: every candidate holds the global batch, invalid combinations never appear, and the
written config is a ds_config the engine loads (issue 44, criteria 1 and 3)."""

from __future__ import annotations

import pytest

from ds_strategy.autotuning import Candidate, SearchSpace
from ds_strategy.autotuning.space import candidates, global_batch, micro_batch_choices
from ds_strategy.config import load_config


def test_the_global_batch_comes_from_the_config() -> None:
    assert global_batch({"train_batch_size": 32}, 2) == 32
    assert global_batch({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2) == 16
    assert global_batch({}, 4) == 4


def test_micro_batches_divide_the_per_rank_batch_within_the_bounds() -> None:
    assert micro_batch_choices(12, 1, 1024, None) == [1, 2, 3, 4, 6, 12]
    assert micro_batch_choices(12, 2, 4, None) == [2, 3, 4]
    assert micro_batch_choices(12, 1, 1024, [5, 6, 8]) == [6]  # explicit ones must divide too


def test_every_candidate_holds_the_global_batch_and_no_invalid_combination_appears() -> None:
    space = SearchSpace(offload_param=("none", "cpu"))
    found = list(candidates(space, [1, 2, 4], 8, fast=True))
    assert found
    for c in found:
        assert c.micro_batch * c.accumulation == 8
        assert not (c.stage == 0 and c.offload_optimizer != "none")
        assert not (c.stage != 3 and c.offload_param != "none")
    assert len(found) == len(set(found))
    stages = {c.stage for c in found}
    assert stages == {0, 1, 2, 3}
    assert any(c.offload_param == "cpu" for c in found)


def test_outside_fast_mode_the_other_knobs_vary_only_where_a_stage_reads_them() -> None:
    space = SearchSpace(stages=(0, 2, 3), offload_optimizer=("none",), activation_checkpointing=(False,),
                        stage3_max_live_parameters=(None, 1000))  # fmt: skip
    slow = list(candidates(space, [2], 4, fast=False))
    fast = list(candidates(space, [2], 4, fast=True))
    assert len(fast) == 3 and len(slow) > len(fast)
    assert all(c.stage3_max_live_parameters is None for c in slow if c.stage != 3)
    assert any(c.stage3_max_live_parameters == 1000 for c in slow if c.stage == 3)
    assert all(c.allgather_bucket_size is None for c in slow if c.stage in (0, 3))


def test_the_written_config_loads_unchanged_and_keeps_the_base_keys() -> None:
    base = {
        "train_batch_size": 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none", "pin_memory": True}},
        "autotuning": {"enabled": True},
    }
    c = Candidate(stage=3, micro_batch=2, accumulation=4, offload_optimizer="cpu", offload_param="cpu",
                  reduce_bucket_size=1000, overlap_comm=False)  # fmt: skip
    out = c.to_config(base, 2)
    assert "autotuning" not in out and base["zero_optimization"]["stage"] == 0  # the base is not changed
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == (
        16,
        2,
        4,
    )
    zero = out["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"]["device"] == "cpu" and zero["reduce_bucket_size"] == 1000
    assert zero["overlap_comm"] is False
    checked = load_config(out, world_size=2)
    assert checked.train_batch_size == 16 and checked.zero_optimization.stage == 3
    assert c.name == "z3_opt-cpu_par-cpu_mb2_rb1K_noov"


def test_bad_spaces_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"SearchSpace\.stages"):
        SearchSpace(stages=(4,))
    with pytest.raises(ValueError, match=r"SearchSpace\.offload_optimizer.*NVMe"):
        SearchSpace(offload_optimizer=("nvme",))
    with pytest.raises(ValueError, match=r"SearchSpace\.micro_batches"):
        SearchSpace(micro_batches=(0,))
