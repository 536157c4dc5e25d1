"""DeepSpeed's tolerated forms load, with a deprecation warning for the structural ones."""

from __future__ import annotations

import re
import warnings

import pytest

from ds_strategy.config import ConfigDeprecationWarning, ConfigError, IgnoredConfigWarning, load_config


def test_zero_optimization_true_is_stage_1_with_a_future_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning, match=r'write "zero_optimization": \{"stage": 1\}') as record:
        config = load_config({"zero_optimization": True})
    assert issubclass(record[0].category, FutureWarning)
    assert config.zero_stage == 1
    with pytest.warns(ConfigDeprecationWarning):
        assert load_config({"zero_optimization": False}).zero_stage == 0


def test_legacy_allgather_size_goes_with_zero_optimization_true() -> None:
    with pytest.warns(ConfigDeprecationWarning):
        config = load_config({"zero_optimization": True, "allgather_size": 2e8})
    assert config.zero_optimization.allgather_bucket_size == 200_000_000


def test_bfloat16_is_bf16() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="bfloat16 is a legacy name; write bf16"):
        config = load_config({"bfloat16": {"enabled": True}})
    assert config.bf16_enabled
    assert config.to_dict()["bf16"] == {"enabled": True}


def test_both_bf16_spellings_disagreeing_is_an_error() -> None:
    with pytest.raises(ConfigError, match="bfloat16: legacy name of bf16, which is also given with a different value"):
        load_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})


def test_gather_fp16_weights_is_gather_16bit_weights() -> None:
    legacy = {"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}}
    with pytest.warns(
        ConfigDeprecationWarning, match="write zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ):
        config = load_config(legacy)
    assert config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_cpu_offload_true_is_offload_optimizer_cpu() -> None:
    with pytest.warns(ConfigDeprecationWarning) as record:
        config = load_config(
            {"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}
        )
    assert [str(w.message) for w in record] == [
        'zero_optimization.cpu_offload is deprecated; write zero_optimization.offload_optimizer: {"device": "cpu"}',
        "zero_optimization.cpu_offload_use_pin_memory is deprecated; "
        "write zero_optimization.offload_optimizer.pin_memory",
    ]
    offload = config.zero_optimization.offload_optimizer
    assert offload.device == "cpu" and offload.enabled and offload.pin_memory is True
    assert not config.zero_optimization.offload_param.enabled
    with pytest.warns(ConfigDeprecationWarning):
        config = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert not config.zero_optimization.offload_optimizer.enabled


def test_cpu_offload_param_true_is_offload_param_cpu() -> None:
    with pytest.warns(ConfigDeprecationWarning):
        config = load_config({"zero_optimization": {"stage": 3, "cpu_offload_param": "true"}})
    assert config.zero_optimization.offload_param.device == "cpu"


def test_cpu_offload_next_to_its_replacement_is_an_error() -> None:
    config = {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(
        ConfigError,
        match=re.escape("zero_optimization.cpu_offload: legacy form of zero_optimization.offload_optimizer"),
    ):
        load_config(config)


def test_seq_parallel_communication_data_type_alias() -> None:
    with (
        pytest.warns(ConfigDeprecationWarning),
        pytest.warns(IgnoredConfigWarning, match="Ulysses. all-to-alls move the activations in their own dtype"),
    ):
        config = load_config({"seq_parallel_communication_data_type": "bf16"})
    assert config.seq_parallel_comm_data_type == "bf16"


def test_scalar_spellings_load_silently() -> None:
    config_in = {
        "train_micro_batch_size_per_gpu": 2.0,
        "wall_clock_breakdown": "False",
        "fp16": {"enabled": "true", "initial_scale_power": 12.0, "consecutive_hysteresis": 1},
        "zero_optimization": {"stage": 3.0, "overlap_comm": "false", "reduce_bucket_size": 3e8},
        "optimizer": {"type": "adamw", "params": {"lr": 1e-4, "amsgrad": "true"}},
        "scheduler": {"type": "warmuplr"},
        "checkpoint": {"tag_validation": "FAIL"},
        "communication_data_type": "bfloat16",
        "data_types": {"grad_accum_dtype": "torch.float32"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config(config_in, world_size=1)
    assert config.train_micro_batch_size_per_gpu == 2 and type(config.train_micro_batch_size_per_gpu) is int
    assert config.wall_clock_breakdown is False
    assert config.fp16.enabled is True and config.fp16.initial_scale_power == 12
    assert config.fp16.consecutive_hysteresis is True
    assert config.zero_stage == 3 and type(config.zero_stage) is int
    assert config.zero_optimization.overlap_comm is False
    assert config.zero_optimization.reduce_bucket_size == 300_000_000
    assert config.optimizer is not None and config.optimizer.type == "AdamW"
    assert config.optimizer.params["amsgrad"] is True
    assert config.scheduler is not None and config.scheduler.type == "WarmupLR"
    assert config.checkpoint.tag_validation == "Fail" and config.checkpoint.tag_validation_fail
    assert config.communication_data_type == "bf16"
    assert config.data_types.grad_accum_dtype == "fp32"


def test_non_integral_float_is_not_an_integer() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("zero_optimization.reduce_bucket_size: got 2.5; expected an integer")
    ):
        load_config({"zero_optimization": {"reduce_bucket_size": 2.5}})


def test_caller_dict_is_not_modified() -> None:
    original = {"zero_optimization": {"stage": 2, "cpu_offload": True}, "bfloat16": {"enabled": "true"}}
    snapshot = repr(original)
    with pytest.warns(ConfigDeprecationWarning):
        load_config(original)
    assert repr(original) == snapshot
