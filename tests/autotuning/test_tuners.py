"""The tuners' orders, the skip of larger micro batches after one did not fit, and early stopping."""

from __future__ import annotations

import pytest

from ds_strategy.autotuning import SearchSpace
from ds_strategy.autotuning.space import candidates
from ds_strategy.autotuning.tuners import EarlyStop, ModelBasedTuner, make_tuner


def _space() -> list:
    space = SearchSpace(stages=(1, 2, 3), offload_optimizer=("none", "cpu"), activation_checkpointing=(False,))
    return list(candidates(space, [1, 2, 4, 8], 8, fast=True))


def _drain(tuner, score) -> list:  # type: ignore[no-untyped-def]
    out = []
    while (c := tuner.next()) is not None:
        out.append(c)
        tuner.record(c, score(c))
    return out


def test_grid_keeps_the_order_and_random_is_a_fixed_shuffle() -> None:
    all_ = _space()
    assert _drain(make_tuner("gridsearch", all_), lambda c: 1.0) == all_
    assert _drain(make_tuner("grid", all_), lambda c: 1.0) == all_
    first = _drain(make_tuner("random", all_), lambda c: 1.0)
    assert sorted(first, key=all_.index) == all_ and first != all_
    assert _drain(make_tuner("random", all_), lambda c: 1.0) == first  # the same on every rank
    with pytest.raises(ValueError, match=r"autotuning\.tuner_type"):
        make_tuner("bayes", all_)


def test_a_micro_batch_that_did_not_fit_skips_the_larger_ones_of_its_group() -> None:
    all_ = _space()
    tried = _drain(make_tuner("gridsearch", all_), lambda c: None if c.micro_batch >= 2 and c.stage == 1 else 1.0)
    stage1 = [c.micro_batch for c in tried if c.stage == 1]
    assert stage1 == [1, 2, 1, 2]  # (none, cpu offload) x (1 fits, 2 does not; 4 and 8 skipped)


def test_model_based_probes_each_group_then_follows_its_model() -> None:
    all_ = _space()

    # A made-up cost: larger micro batches are faster, stage 3 slower, offload much slower.
    def cost(c):  # type: ignore[no-untyped-def]
        return c.micro_batch * (0.5 if c.stage == 3 else 1.0) * (0.2 if c.offload_optimizer != "none" else 1.0)

    tuner = ModelBasedTuner(all_)
    order = []
    for _ in range(len({c.group for c in all_}) + 2):
        c = tuner.next()
        assert c is not None
        order.append(c)
        tuner.record(c, cost(c))
    probes = order[: len({c.group for c in all_})]
    assert all(c.micro_batch == 8 for c in probes) and len({c.group for c in probes}) == len(probes)
    # Groups that trade speed for memory (offload here) are probed after those that do not.
    assert [c.offload_optimizer for c in probes] == ["none"] * 3 + ["cpu"] * 3
    # After the probes the model's best untried guess is a large micro batch without offload, not stage 3.
    assert order[-2].offload_optimizer == "none" and order[-2].micro_batch == 4


def test_early_stopping_counts_trials_without_improvement() -> None:
    stop = EarlyStop(2)
    assert not any(stop.update(None) for _ in range(5))  # nothing fitted yet: the search goes on
    assert not stop.update(1.0)
    assert not stop.update(0.5)
    assert not stop.update(2.0)  # an improvement resets the count
    assert not stop.update(None)  # did not fit: no improvement
    assert stop.update(1.0)
    assert not EarlyStop(0).update(None)  # 0: never stop early
