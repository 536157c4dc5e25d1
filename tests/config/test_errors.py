"""The text of the main error messages: path, bad value, what is valid, did-you-mean, all at once."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from ds_strategy.config import ConfigContext, ConfigError, ConfigProblem, find_problems, load_config


def _problems(config: Any, **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)
    return [str(p) for p in info.value.problems]


def test_unknown_key_suggests_the_nearest_key() -> None:
    assert _problems({"zero_optimization": {"stag": 2}}) == [
        "zero_optimization.stag: unknown key; did you mean 'stage'?"
    ]
    assert _problems({"train_micro_batch_size_per_gpus": 2}) == [
        "train_micro_batch_size_per_gpus: unknown key; did you mean 'train_micro_batch_size_per_gpu'?"
    ]
    assert _problems({"fp16": {"intial_scale_power": 12}}) == [
        "fp16.intial_scale_power: unknown key; did you mean 'initial_scale_power'?"
    ]


def test_unknown_key_without_a_close_match_lists_the_valid_keys() -> None:
    (problem,) = _problems({"bf16": {"xyz": 1}})
    assert problem.startswith("bf16.xyz: unknown key; valid keys here: bf16_master_weights_and_grads")
    (problem,) = _problems({"qqqqqq": 1})
    assert problem == "qqqqqq: unknown key; see docs/config.md for the valid keys"


def test_misplaced_optimizer_argument_is_an_unknown_key() -> None:
    (problem,) = _problems({"optimizer": {"type": "Adam", "adam_w_mode": True, "params": {"lr": 1e-3}}})
    assert problem == "optimizer.adam_w_mode: unknown key; valid keys here: legacy_fusion, params, type"


def test_typo_in_optimizer_and_scheduler_params() -> None:
    problems = _problems(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
        }
    )
    assert problems == [
        "optimizer.params.weight_decy: unknown key; did you mean 'weight_decay'?",
        "scheduler.params.warmup_num_step: unknown key; did you mean 'warmup_num_steps'?",
    ]


def test_wrong_type_names_value_and_expectation() -> None:
    assert _problems({"fp16": {"loss_scale_window": "1000x"}}) == [
        'fp16.loss_scale_window: got "1000x" (string); expected an integer >= 1'
    ]
    assert _problems({"zero_optimization": {"reduce_bucket_size": "big"}}) == [
        'zero_optimization.reduce_bucket_size: got "big" (string); expected an integer >= 0 or "auto"'
    ]
    assert _problems({"bf16": {"enabled": "yes"}}) == ['bf16.enabled: got "yes" (string); expected a boolean or "auto"']
    assert _problems({"gradient_clipping": -1}) == ["gradient_clipping: got -1; expected a number >= 0"]
    assert _problems({"train_batch_size": 0}) == ["train_batch_size: got 0; expected an integer >= 1"]
    assert _problems({"zero_optimization": {"stage": 2, "sub_group_size": 1.5}}) == [
        'zero_optimization.sub_group_size: got 1.5; expected an integer >= 0 or "auto"'
    ]
    assert _problems({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}) == [
        "optimizer.params.betas: got [0.9] (array); expected an array of 2 numbers >= 0 and < 1"
    ]


def test_bad_enum_lists_the_choices_and_suggests() -> None:
    assert _problems({"zero_optimization": {"stage": 4}}) == [
        "zero_optimization.stage: got 4; expected one of 0, 1, 2, 3"
    ]
    (problem,) = _problems({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})
    assert problem == (
        'zero_optimization.offload_param.device: got "gpu" (string); expected one of "none", "cpu", "nvme"; '
        "did you mean 'cpu'?"
    )
    (problem,) = _problems({"scheduler": {"type": "WarmupCosine", "params": {}}})
    assert problem.startswith('scheduler.type: got "WarmupCosine" (string); expected one of "WarmupLR", ')
    assert problem.endswith("did you mean 'WarmupCosineLR'?")
    (problem,) = _problems({"communication_data_type": "fp8"})
    assert problem == 'communication_data_type: got "fp8" (string); expected one of "fp16", "bf16", "fp32" or null'


def test_missing_required_keys() -> None:
    assert _problems({"optimizer": {"params": {"lr": 1}}}) == ["optimizer.type: is required here but missing"]
    assert _problems({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}}) == [
        "scheduler.params.total_num_steps: is required here but missing"
    ]


def test_cross_field_rules() -> None:
    assert _problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == [
        "bf16.enabled: fp16.enabled and bf16.enabled are both true; enable at most one"
    ]
    assert _problems({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}) == [
        'zero_optimization.offload_param.device: parameter offload ("cpu") needs ZeRO stage 3, but '
        "zero_optimization.stage is 2; use offload_optimizer for stages 1-2"
    ]
    assert _problems({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) == [
        'zero_optimization.offload_optimizer.device: optimizer offload ("cpu") needs ZeRO stage 1, 2 or 3, '
        "but zero_optimization.stage is 0"
    ]
    problems = _problems({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "ratio": 0.5}}})
    assert problems == [
        'zero_optimization.offload_optimizer.nvme_path: offload_optimizer.device is "nvme" but nvme_path is null; '
        "set it to a directory on a fast local disk (its swap files go there)",
        'zero_optimization.offload_optimizer.ratio: got 0.5 with offload_optimizer.device "nvme"; a partial offload '
        "to NVMe is not built (the swapped part would have to be split from the device part); use device "
        '"cpu" with a ratio, or NVMe with ratio 1',
    ]
    problems = _problems(
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_count": 0}}}
    )
    assert problems == [
        "zero_optimization.offload_param.buffer_count: got 0; NVMe offload needs at least 1 buffer (DeepSpeed's "
        "default: 5)"
    ]


def test_all_problems_are_reported_together() -> None:
    config = {
        "train_batch_sise": 16,
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": "maybe", "hysteresis": 0},
        "zero_optimization": {"stage": 2, "overlap_com": True, "offload_param": {"device": "cpu"}},
        "optimizer": {"type": "adamw", "params": {"lr": "fast"}},
    }
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=2)
    paths = [p.path for p in info.value.problems]
    assert paths == [
        "train_batch_sise",
        "fp16.enabled",
        "fp16.hysteresis",
        "optimizer.params.lr",
        "zero_optimization.overlap_com",
        "train_batch_size",
        "zero_optimization.offload_param.device",
    ]
    text = str(info.value)
    assert text.startswith("invalid DeepSpeed config: 7 problems\n  - train_batch_sise: unknown key;")
    assert "zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?" in text
    assert "32 != 4 * 2 * 2 = 16" in text


def test_problem_from_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 9}}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"invalid DeepSpeed config ({path}): zero_optimization.stage: got 9; expected one of 0, 1, 2, 3"
    )


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n "fp16": {"enabled": true,}}')
    with pytest.raises(ConfigError, match=r"not valid JSON: .* at line 2, column"):
        load_config(bad)
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(dup)
    listing = tmp_path / "list.json"
    listing.write_text("[1]")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        load_config(listing)


def test_non_string_keys_and_wrong_input_type() -> None:
    with pytest.raises(ConfigError, match="keys must be strings"):
        load_config({1: 2})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="config must be a dict"):
        load_config(42)  # type: ignore[arg-type]


def test_context_problems_name_the_context_field() -> None:
    with pytest.raises(ConfigError, match=r"context.micro_batch_size: got 0; expected a positive integer"):
        ConfigContext(micro_batch_size=0)
    with pytest.raises(ConfigError, match=re.escape("context.precision: got 'fp8-mixed'")):
        ConfigContext(precision="fp8-mixed")
    with pytest.raises(
        ConfigError, match=re.escape("context.micro_batch: unknown context field; did you mean 'micro_batch_size'?")
    ):
        load_config({}, context={"micro_batch": 4})


def test_find_problems_returns_problems_without_raising_or_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_problems({"zero_optimization": True, "tensorboard": {"enabled": True}}) == []
        assert find_problems({"steps_per_print": 0}) == [
            ConfigProblem("steps_per_print", "got 0; expected an integer >= 1")
        ]


def test_config_error_pickles_with_its_problems() -> None:
    error = ConfigError([ConfigProblem("a.b", "bad")], source="x.json")
    clone = pickle.loads(pickle.dumps(error))
    assert isinstance(clone, ConfigError) and isinstance(clone, ValueError)
    assert clone.problems == error.problems and clone.source == "x.json" and str(clone) == str(error)
