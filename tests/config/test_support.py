"""Every schema key is acted on, warned about or refused (config/support.py), and the loader applies it.

The walk is independent of ``support.py``: it reads the JSON Schema itself, including the per-type
``optimizer.params`` / ``scheduler.params`` that only ``allOf``/``if``/``then`` clauses declare, so a key
added to the schema without a classification fails here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import ds_strategy
from ds_strategy.config import ConfigError, IgnoredConfigWarning, load_config, load_schema
from ds_strategy.config.schema import resolve
from ds_strategy.config.support import ACTED, REFUSED, SUPPORT, WARNED


def schema_paths() -> Iterator[str]:
    """Dotted path of every key the schema declares (per-type params under ``<owner>.params.<key>``)."""

    def walk(path: str, node: dict[str, Any]) -> Iterator[str]:
        for key, prop in node.get("properties", {}).items():
            child = resolve(prop)
            full = f"{path}.{key}" if path else key
            yield full
            if not child.get("x-ignored"):
                yield from walk(full, child)
        for clause in node.get("allOf", []):
            for owner, prop in clause.get("then", {}).get("properties", {}).items():
                yield from walk(f"{path}.{owner}", resolve(prop))

    yield from dict.fromkeys(walk("", resolve(load_schema())))


PATHS = list(schema_paths())


def test_the_walk_reaches_nested_and_per_type_keys() -> None:
    for expected in (
        "zero_optimization.offload_optimizer.ratio",
        "optimizer.params.torch_adam",
        "scheduler.params.total_num_steps",
        "activation_checkpointing.profile",
        "tensorboard",
    ):
        assert expected in PATHS
    assert len(PATHS) > 180


@pytest.mark.parametrize("path", PATHS)
def test_every_schema_key_is_classified(path: str) -> None:
    entry = SUPPORT.get(path)
    assert entry is not None, f"{path} is in the schema but not in config/support.py (acted, warned or refused)"
    assert entry.kind in (ACTED, WARNED, REFUSED)
    if entry.kind != ACTED:
        assert entry.note, f"{path}: a warned or refused key must say why"


def test_no_classification_for_a_key_the_schema_lacks() -> None:
    assert not set(SUPPORT) - set(PATHS)


def test_the_warning_class_is_public() -> None:
    assert ds_strategy.IgnoredConfigWarning is IgnoredConfigWarning


@pytest.mark.parametrize(
    "config,path",
    [
        ({"aio": {"use_gds": True}}, "aio.use_gds"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
            "offload_optimizer.super_offload",
        ),
        ({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}}, "zeropp_loco_param"),
        ({"torch_autocast": {"enabled": True}}, "torch_autocast"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
    ],
)
def test_refused_settings_raise_naming_the_key(config: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError, match="not supported by ds_strategy") as info:
        load_config(config)
    assert any(p.path.endswith(path) for p in info.value.problems), info.value.problems


def test_refusal_only_for_values_that_ask_for_it() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(
            {
                "sequence_parallel_size": 1,
                "torch_autocast": {"enabled": False},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.0}},
            }
        )


def test_one_warning_per_ignored_key_naming_it_and_why() -> None:
    config = {
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},  # acted on
        "tensorboard": {"enabled": True, "output_path": "x"},
        "zero_optimization": {"stage": 1, "round_robin_gradients": True, "compute_grad_norm": False},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config)
    messages = [str(w.message) for w in caught if issubclass(w.category, IgnoredConfigWarning)]
    assert len(messages) == 3, messages
    assert any(
        m.startswith("zero_optimization.compute_grad_norm (false) is accepted but ignored: ")
        and "always computes the global gradient norm" in m
        for m in messages
    ), messages
    assert any(m.startswith("tensorboard (") and "monitors are not built" in m for m in messages)
    assert any(m.startswith("zero_optimization.round_robin_gradients (true)") for m in messages)


def test_defaults_and_disabled_sections_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"activation_checkpointing": {"profile": False}, "wandb": {"enabled": False}})


def test_the_warning_is_printed_by_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"tensorboard": {"enabled": True}}
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(config)
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(IgnoredConfigWarning, match="tensorboard"):
        load_config(config)


def test_re_resolving_a_loaded_config_does_not_warn_again() -> None:
    with pytest.warns(IgnoredConfigWarning):
        loaded = load_config({"tensorboard": {"enabled": True}, "train_micro_batch_size_per_gpu": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_config(loaded, world_size=4)
    assert again.batch.train_batch_size == 8


def test_keys_marked_x_ignored_are_never_classified_as_acted_on() -> None:
    def ignored(path: str) -> bool:
        node: dict[str, Any] = resolve(load_schema())
        for part in path.split("."):
            props = node.get("properties", {})
            if part not in props:
                return False  # per-type params: never x-ignored
            node = resolve(props[part])
        return bool(node.get("x-ignored"))

    acted = [p for p in PATHS if ignored(p) and SUPPORT[p].kind == ACTED]
    assert not acted, f"the loader drops x-ignored keys, so they cannot be acted on: {acted}"


def test_sequence_parallel_size_divides_the_ranks_and_the_batch_counts_data_parallel_ranks() -> None:
    """Ulysses: ``sequence_parallel_size`` ranks hold one sequence, so the batch arithmetic uses ranks / sp."""
    config = load_config({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2}, world_size=8)
    assert (config.world_size, config.sequence_parallel_size, config.train_batch_size) == (4, 2, 8)
    # re-resolving keeps the ranks it was resolved for
    assert load_config(config, context={"micro_batch_size": 2}).world_size == 4
    with pytest.raises(
        ConfigError,
        match=r"sequence_parallel_size: 3 does not divide the 8 ranks \(valid for 8 ranks: \[1, 2, 4, 8\]\)",
    ):
        load_config({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 3}, world_size=8)


@pytest.mark.parametrize("offload", [{"device": "none", "ratio": 0.5}, {"ratio": 0.3}])
def test_a_ratio_without_an_offload_device_warns_that_it_does_nothing(offload: dict[str, Any]) -> None:
    from ds_strategy.config import ConfigWarning

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_optimizer": offload}}
    with pytest.warns(ConfigWarning, match=r"offload_optimizer\.ratio .* does nothing: offload_optimizer\.device is"):
        load_config(config, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(
            {**config, "zero_optimization": {"stage": 2, "offload_optimizer": {**offload, "device": "cpu"}}},
            world_size=1,
        )
