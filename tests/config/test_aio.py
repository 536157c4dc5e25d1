"""The ``aio`` block is validated once, by ``AioConfig`` (config/model.py); the I/O engine's ``AioOptions``
(ops/aio.py) and the engine's offload settings take the validated values."""

from __future__ import annotations

from typing import Any

import pytest

from ds_strategy.config import AioConfig, ConfigError, load_config
from ds_strategy.config.model import AIO_ALIGNMENT


@pytest.mark.parametrize(
    ("block", "path", "message"),
    [
        ({"block_size": 1000}, "aio.block_size",
         "got 1000; expected a multiple of 4096 bytes (the O_DIRECT unit), for example 4096"),
        ({"block_size": 0}, "aio.block_size", "got 0; expected a positive integer"),
        ({"queue_depth": -1}, "aio.queue_depth", "got -1; expected a positive integer"),
        ({"thread_count": 2.0}, "aio.thread_count", "got 2.0; expected a positive integer"),
        ({"thread_count": True}, "aio.thread_count", "got true; expected a positive integer"),
        ({"intra_op_parallelism": 0}, "aio.intra_op_parallelism", "got 0; expected a positive integer"),
        ({"single_submit": "yes"}, "aio.single_submit", 'got "yes"; expected true or false'),
        ({"overlap_events": 1}, "aio.overlap_events", "got 1; expected true or false"),
        ({"queue_size": 8}, "aio.queue_size", "unknown key; valid keys are block_size, intra_op_parallelism, "
         "overlap_events, queue_depth, single_submit, thread_count, use_gds"),
        ({"use_gds": True}, "aio.use_gds", "GPUDirect Storage is not supported; set it to false"),
    ],
)  # fmt: skip
def test_a_bad_block_names_the_key(block: dict[str, Any], path: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        AioConfig.from_block(block)
    assert [(p.path, p.message) for p in info.value.problems] == [(path, message)]


def test_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        AioConfig(block_size=5000, queue_depth=0)
    assert [p.path for p in info.value.problems] == ["aio.block_size", "aio.queue_depth"]


def test_the_newer_name_for_the_thread_count_wins() -> None:
    assert AioConfig.from_block(None) == AioConfig()
    assert AioConfig.from_block({"thread_count": 2}).threads == 2
    assert AioConfig.from_block({"thread_count": 2, "intra_op_parallelism": 3}).threads == 3


def test_a_whole_config_validates_its_block() -> None:
    """``load_config`` builds the same ``AioConfig``: a block size the schema lets through (above its
    minimum) but the O_DIRECT unit does not divide fails at load, not when the engine opens its files."""
    assert load_config({"aio": {"intra_op_parallelism": 4}}).aio.threads == 4
    with pytest.raises(ConfigError, match=r"aio\.block_size: got 5000; expected a multiple of 4096"):
        load_config({"aio": {"block_size": 5000}})


def test_the_io_engine_and_the_engine_take_the_validated_values() -> None:
    """ops/aio.py's ``AioOptions`` and the engine's offload settings read what ``AioConfig`` resolved (the
    thread count under either name), with the same defaults and the same O_DIRECT unit."""
    from ds_strategy.ops.aio import ALIGNMENT, AioOptions
    from ds_strategy.runtime.zero.offload import Offload

    assert AIO_ALIGNMENT == ALIGNMENT
    assert AioOptions.from_config(AioConfig()) == AioOptions()
    config = load_config({"aio": {"block_size": 8192, "queue_depth": 4, "intra_op_parallelism": 3}})
    want = AioOptions(block_size=8192, queue_depth=4, thread_count=3)
    assert AioOptions.from_config(config.aio) == want
    assert Offload.from_config(config.zero_optimization, config.aio).aio == want
