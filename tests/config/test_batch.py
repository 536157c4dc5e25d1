"""Batch arithmetic: train_batch_size = micro * accumulation * world_size; any two determine the third."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_strategy.config import BatchSizes, ConfigError, load_config, resolve_batch_sizes

sizes = st.integers(min_value=1, max_value=64)
FAST = settings(max_examples=150, deadline=None)


def _holds(b: BatchSizes) -> bool:
    return b.train_batch_size == b.train_micro_batch_size_per_gpu * b.gradient_accumulation_steps * b.world_size


@FAST
@given(mb=sizes, gas=sizes, ws=sizes)
def test_any_two_determine_the_third(mb: int, gas: int, ws: int) -> None:
    tb = mb * gas * ws
    expected = BatchSizes(
        train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas, world_size=ws
    )
    assert resolve_batch_sizes(None, mb, gas, ws) == expected
    assert resolve_batch_sizes(tb, mb, None, ws) == expected
    assert resolve_batch_sizes(tb, None, gas, ws) == expected
    assert resolve_batch_sizes(tb, mb, gas, ws) == expected


@FAST
@given(mb=sizes, gas=sizes, ws=sizes, delta=st.integers(min_value=1, max_value=1000))
def test_contradiction_prints_the_equation_with_the_numbers(mb: int, gas: int, ws: int, delta: int) -> None:
    tb = mb * gas * ws + delta
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(tb, mb, gas, ws)
    text = str(info.value)
    assert f"{tb} != {mb} * {gas} * {ws} = {mb * gas * ws}" in text
    assert "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size" in text
    assert info.value.problems[0].path == "train_batch_size"


@FAST
@given(tb=st.integers(min_value=1, max_value=4096), ws=sizes)
def test_only_train_batch_size_accumulates_once(tb: int, ws: int) -> None:
    if tb % ws:
        with pytest.raises(ConfigError, match=rf"{tb} / \(1 \* {ws}\) = .* is not a positive integer"):
            resolve_batch_sizes(tb, None, None, ws)
    else:
        result = resolve_batch_sizes(tb, None, None, ws)
        assert result.gradient_accumulation_steps == 1 and result.train_micro_batch_size_per_gpu == tb // ws


@FAST
@given(mb=sizes, ws=sizes)
def test_only_micro_batch_accumulates_once(mb: int, ws: int) -> None:
    result = resolve_batch_sizes(None, mb, None, ws)
    assert (result.train_batch_size, result.gradient_accumulation_steps) == (mb * ws, 1)


@FAST
@given(tb=st.integers(min_value=1, max_value=4096), mb=sizes, ws=sizes)
def test_derived_accumulation_is_exact_or_an_error(tb: int, mb: int, ws: int) -> None:
    try:
        result = resolve_batch_sizes(tb, mb, None, ws)
    except ConfigError as exc:
        assert tb % (mb * ws) != 0 or tb < mb * ws
        assert exc.problems[0].path == "gradient_accumulation_steps"
        assert f"{tb} / ({mb} * {ws})" in str(exc)
    else:
        assert _holds(result) and result.train_micro_batch_size_per_gpu == mb


@pytest.mark.parametrize(
    ("args", "path"),
    [
        ((0, None, None, 1), "train_batch_size"),
        ((None, -2, None, 1), "train_micro_batch_size_per_gpu"),
        ((None, 2, 0, 1), "gradient_accumulation_steps"),
        ((None, 2, 1, 0), "world_size"),
        ((8, True, None, 1), "train_micro_batch_size_per_gpu"),
    ],
)
def test_non_positive_values_are_rejected(args: tuple[int | None, int | None, int | None, int], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*args)
    assert info.value.problems[0].path == path
    assert "must be a positive integer" in str(info.value)


def test_nothing_to_resolve_from() -> None:
    with pytest.raises(ConfigError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch_sizes(None, None, 4, 2)


def test_load_config_reports_the_batch_equation() -> None:
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match=r"32 != 4 \* 2 \* 2 = 16"):
        load_config(config, world_size=2)
    assert load_config(config, world_size=4).batch.world_size == 4


def test_without_world_size_the_triple_must_still_admit_some_world_size() -> None:
    with pytest.raises(ConfigError, match=r"cannot hold for any world size: 30 / \(4 \* 2\) = 3.75"):
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    partial = load_config({"train_micro_batch_size_per_gpu": 4})
    assert not partial.batch_resolved
    with pytest.raises(ConfigError, match="the data-parallel world size is needed"):
        _ = partial.batch
    assert load_config(partial, world_size=3).batch.train_batch_size == 12
