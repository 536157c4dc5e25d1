"""The ``autotuning`` block: typed, validated, DeepSpeed's defaults, refusals with their reasons, the memory cap."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest

from ds_strategy.config import AutotuningConfig, ConfigError, IgnoredConfigWarning, load_config, load_schema
from ds_strategy.config.checks import parse_memory_size
from ds_strategy.config.schema import resolve
from ds_strategy.config.support import ACTED, SUPPORT

DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "metric": "throughput",
    "start_profile_step": 3,
    "end_profile_step": 5,
    "fast": True,
    "max_train_batch_size": None,
    "max_train_micro_batch_size_per_gpu": 1024,
    "min_train_micro_batch_size_per_gpu": 1,
    "num_tuning_micro_batch_sizes": 3,
    "tuner_type": "gridsearch",
    "tuner_early_stopping": 5,
    "tuner_num_trials": 50,
    "results_dir": "autotuning_results",
    "exps_dir": "autotuning_exps",
    "overwrite": True,
    "mp_size": 1,
}
REFUSED_KEYS = ("arg_mappings", "model_info", "model_info_path", "metric_path")


def _problems(block: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config({"autotuning": block})
    return {p.path: p.message for p in info.value.problems}


def test_defaults_are_deepspeeds_and_the_loaded_block_is_typed() -> None:
    loaded = load_config({}).autotuning
    assert loaded == AutotuningConfig()
    for key, value in DEEPSPEED_DEFAULTS.items():
        assert getattr(loaded, key) == value, key
    assert loaded.max_memory_per_rank is None and loaded.time_budget_s is None
    assert loaded.memory_cap("cpu") is None


def test_fields_mirror_the_schema_less_the_refused_and_warned_keys() -> None:
    node = resolve(load_schema()["properties"]["autotuning"])
    fields = {f.name for f in dataclasses.fields(AutotuningConfig)}
    acted = {k for k in node["properties"] if SUPPORT[f"autotuning.{k}"].kind == ACTED}
    assert acted | {"mp_size"} == fields
    for name in fields:
        assert resolve(node["properties"][name])["default"] == getattr(AutotuningConfig(), name), name
    assert set(node["properties"]) - fields == {*REFUSED_KEYS, "min_train_batch_size"}


def test_values_are_read_and_round_trip() -> None:
    block = {
        "enabled": True,
        "metric": "latency",
        "start_profile_step": 2,
        "end_profile_step": 4,
        "fast": False,
        "max_train_batch_size": 64,
        "max_train_micro_batch_size_per_gpu": 16,
        "min_train_micro_batch_size_per_gpu": 2,
        "tuner_type": "random",
        "tuner_num_trials": 7,
        "results_dir": "out",
        "overwrite": False,
        "max_memory_per_rank": "16GB",
        "time_budget_s": 300,
    }
    config = load_config({"autotuning": block})
    tuning = config.autotuning
    assert (tuning.metric, tuning.tuner_type, tuning.fast, tuning.max_train_batch_size) == (
        "latency",
        "random",
        False,
        64,
    )
    assert tuning.time_budget_s == 300.0 and isinstance(tuning.time_budget_s, float)
    assert load_config(config.to_dict()).autotuning == tuning
    assert AutotuningConfig.from_block(block) == tuning


@pytest.mark.parametrize("spelling", ["grid", "GRID", "gridsearch", "GridSearch"])
def test_grid_is_an_alias_of_gridsearch(spelling: str) -> None:
    assert load_config({"autotuning": {"tuner_type": spelling}}).autotuning.tuner_type == "gridsearch"
    assert AutotuningConfig(tuner_type=spelling).tuner_type == "gridsearch"  # type: ignore[arg-type]


@pytest.mark.parametrize("metric", ["forward", "step", "steps"])
def test_deepspeeds_partial_metrics_are_refused_with_the_reason(metric: str) -> None:
    message = _problems({"metric": metric})["autotuning.metric"]
    assert "is not supported by ds_strategy" in message and "whole training steps" in message
    assert '"throughput"' in message and '"latency"' in message and '"flops"' in message


def test_an_unknown_metric_and_tuner_are_schema_errors() -> None:
    found = _problems({"metric": "speed", "tuner_type": "bayes"})
    assert '"throughput", "latency", "flops"' in found["autotuning.metric"]
    assert '"gridsearch", "random", "model_based"' in found["autotuning.tuner_type"]


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("arg_mappings", {"train_micro_batch_size_per_gpu": "--micro"}, "no command line is rewritten"),
        ("model_info", {"num_params": 10}, "the model is profiled in-process at the start of the tune"),
        ("model_info_path", "info.json", "the model is profiled in-process at the start of the tune"),
        ("metric_path", "metrics.json", "trial metrics stay in memory and go to results_dir"),
        ("mp_size", 2, "ds_strategy tunes data-parallel ZeRO configurations; model parallelism is not tuned"),
    ],
)
def test_keys_that_make_no_sense_in_process_are_refused_with_the_reason(key: str, value: Any, reason: str) -> None:
    message = _problems({key: value})[f"autotuning.{key}"]
    assert reason in message and "is not supported by ds_strategy" in message
    with pytest.raises(ConfigError, match=rf"autotuning\.{key}"):
        AutotuningConfig.from_block({key: value})


def test_refused_keys_at_their_null_defaults_load() -> None:
    tuning = load_config({"autotuning": {**dict.fromkeys(REFUSED_KEYS), "mp_size": 1}}).autotuning
    assert tuning == AutotuningConfig()


def test_mp_size_refused_on_direct_construction() -> None:
    with pytest.raises(ConfigError, match="model parallelism is not tuned"):
        AutotuningConfig(mp_size=4)


def test_profile_steps_must_be_ordered_and_start_at_one() -> None:
    found = _problems({"start_profile_step": 5, "end_profile_step": 5})
    assert "not after start_profile_step (5)" in found["autotuning.end_profile_step"]
    assert "expected an integer >= 1" in _problems({"start_profile_step": 0})["autotuning.start_profile_step"]
    with pytest.raises(ConfigError, match=r"autotuning\.end_profile_step"):
        AutotuningConfig(start_profile_step=4, end_profile_step=2)


def test_micro_batch_range_must_not_be_empty() -> None:
    found = _problems({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4})
    assert "above max_train_micro_batch_size_per_gpu (4)" in found["autotuning.min_train_micro_batch_size_per_gpu"]
    assert load_config(
        {"autotuning": {"min_train_micro_batch_size_per_gpu": 4, "max_train_micro_batch_size_per_gpu": 4}}
    )


def test_unknown_keys_get_the_unknown_key_error() -> None:
    assert _problems({"tuner_trials": 3})["autotuning.tuner_trials"].startswith("unknown key")
    with pytest.raises(ConfigError, match=r"autotuning\.nope: unknown key"):
        AutotuningConfig.from_block({"nope": 1})


def test_every_problem_is_reported_at_once() -> None:
    found = _problems({"metric": "forward", "model_info_path": "x", "end_profile_step": 3})
    assert set(found) == {"autotuning.metric", "autotuning.model_info_path", "autotuning.end_profile_step"}


def test_min_train_batch_size_is_warned_not_refused() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"autotuning": {"min_train_batch_size": 8}})
    assert any(
        issubclass(w.category, IgnoredConfigWarning) and "autotuning.min_train_batch_size" in str(w.message)
        for w in caught
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("4096B", 4096),
        ("16GB", 16 * 10**9),
        ("16 gb", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("2KB", 2000),
        ("2KiB", 2048),
        ("1TiB", 2**40),
    ],
)
def test_memory_sizes_parse(text: int | str, size: int) -> None:
    assert parse_memory_size(text) == size
    assert AutotuningConfig(max_memory_per_rank=text).memory_cap("cpu") == size
    assert load_config({"autotuning": {"max_memory_per_rank": text}}).autotuning.max_memory_per_rank == text


@pytest.mark.parametrize("text", ["16G", "16 potatoes", "GB", "-1GB", "0GB", "1 KIB B", ""])
def test_bad_memory_sizes_are_refused(text: str) -> None:
    message = _problems({"max_memory_per_rank": text})["autotuning.max_memory_per_rank"]
    assert '"16GB"' in message and '"auto"' in message


def test_non_positive_byte_counts_are_schema_errors() -> None:
    assert ">= 1" in _problems({"max_memory_per_rank": 0})["autotuning.max_memory_per_rank"]


def test_auto_cap_is_the_hosts_available_memory_on_cpu() -> None:
    tuning = load_config({"autotuning": {"max_memory_per_rank": "auto"}}).autotuning
    cap = tuning.memory_cap("cpu")
    with open("/proc/meminfo", encoding="ascii") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert cap is not None and abs(cap - available) < max(available // 10, 256 * 2**20)
    assert AutotuningConfig(max_memory_per_rank="AUTO").memory_cap("cpu") is not None
    assert tuning.memory_cap("meta") is None  # a device kind whose free memory nothing reports


def test_auto_cap_on_cuda_asks_mem_get_info(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    asked: list[Any] = []

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        asked.append(device)
        return 7 * 2**30, 16 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert AutotuningConfig(max_memory_per_rank="auto").memory_cap("cuda:0") == 7 * 2**30
    assert asked == [torch.device("cuda:0")]
