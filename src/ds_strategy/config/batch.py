"""Batch arithmetic: train_batch_size = micro_batch_per_rank * gradient_accumulation_steps * world_size.

Any two of the three (plus the data-parallel world size) determine the third; DeepSpeed's rules for
underdetermined configs are kept (only train_batch_size: accumulate 1; only the micro batch: accumulate
1). A contradiction or a non-integral derived value raises a ``ConfigError`` that prints the equation
with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, ConfigProblem

EQUATION = "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"


@dataclass(frozen=True, kw_only=True)
class BatchSizes:
    """The resolved batch triple and the data-parallel world size it was resolved for."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int


def resolve_batch_sizes(
    train_batch_size: int | None,
    micro_batch: int | None,
    grad_accum: int | None,
    world_size: int,
) -> BatchSizes:
    """Complete and check the batch triple for ``world_size`` data-parallel ranks."""
    problems = [
        ConfigProblem(name, f"must be a positive integer, got {value!r}")
        for name, value in (
            ("train_batch_size", train_batch_size),
            ("train_micro_batch_size_per_gpu", micro_batch),
            ("gradient_accumulation_steps", grad_accum),
            ("world_size", world_size),
        )
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
    ]
    if problems:
        raise ConfigError(problems)
    tb, mb, gas, ws = train_batch_size, micro_batch, grad_accum, world_size

    if tb is None and mb is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "train_batch_size",
                    "cannot be resolved: give train_batch_size or train_micro_batch_size_per_gpu "
                    "(in the config, or a micro batch size in the context)",
                )
            ]
        )
    if tb is None:
        assert mb is not None
        gas = 1 if gas is None else gas
        return BatchSizes(
            train_batch_size=mb * gas * ws,
            train_micro_batch_size_per_gpu=mb,
            gradient_accumulation_steps=gas,
            world_size=ws,
        )
    if mb is None:
        gas = 1 if gas is None else gas
        mb = _exact_quotient(tb, gas * ws, "train_micro_batch_size_per_gpu", f"{tb} / ({gas} * {ws})")
    elif gas is None:
        gas = _exact_quotient(tb, mb * ws, "gradient_accumulation_steps", f"{tb} / ({mb} * {ws})")
    if tb != mb * gas * ws:
        raise ConfigError(
            [
                ConfigProblem(
                    "train_batch_size", f"{EQUATION} does not hold: {tb} != {mb} * {gas} * {ws} = {mb * gas * ws}"
                )
            ]
        )
    return BatchSizes(
        train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas, world_size=ws
    )


def _exact_quotient(numerator: int, denominator: int, name: str, shown: str) -> int:
    quotient, remainder = divmod(numerator, denominator)
    if remainder or quotient < 1:
        raise ConfigError(
            [
                ConfigProblem(
                    name,
                    f"cannot be derived from {EQUATION}: {shown} = {numerator / denominator:g} is not a positive "
                    f"integer (train_batch_size must be a multiple of {denominator})",
                )
            ]
        )
    return quotient


def check_without_world_size(train_batch_size: int, micro_batch: int, grad_accum: int) -> None:
    """All three given but no world size yet: at least some integer world size must fit."""
    per_rank = micro_batch * grad_accum
    if train_batch_size % per_rank:
        raise ConfigError(
            [
                ConfigProblem(
                    "train_batch_size",
                    f"{EQUATION} cannot hold for any world size: {train_batch_size} / ({micro_batch} * {grad_accum}) "
                    f"= {train_batch_size / per_rank:g} is not an integer",
                )
            ]
        )
