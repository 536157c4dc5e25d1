"""Defaults follow DeepSpeed's code; the schema, the dataclasses and the docs agree on them."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from ds_strategy.config import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    DataTypesConfig,
    DeepSpeedConfig,
    FP16Config,
    LeafModuleConfig,
    OffloadConfig,
    ZeroConfig,
    load_config,
    load_schema,
)
from ds_strategy.config.schema import resolve

# Values read from DeepSpeed's code (runtime/constants.py, runtime/precision_config.py, runtime/zero/config.py,
# runtime/zero/offload_config.py, comm/config.py, runtime/activation_checkpointing/config.py).
DEEPSPEED_CODE_DEFAULTS: dict[str, Any] = {
    "steps_per_print": None,
    "wall_clock_breakdown": False,
    "gradient_clipping": 1.0,  # DeepSpeed 0.19.8: GRADIENT_CLIPPING_DEFAULT = 1.0
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "communication_data_type": None,
    "seq_parallel_comm_data_type": "fp32",
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "fp16.enabled": False,
    "fp16.auto_cast": False,
    "fp16.loss_scale": 0.0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1,
    "bf16.enabled": False,
    "zero_optimization.stage": 0,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.overlap_comm": False,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_model_persistence_threshold": sys.maxsize,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.offload_optimizer.pin_memory": False,
    "zero_optimization.offload_optimizer.buffer_count": 4,
    "zero_optimization.offload_optimizer.ratio": 1.0,
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.offload_param.buffer_count": 5,
    "zero_optimization.offload_param.buffer_size": 100_000_000,
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000,
    # runtime/zero/leaf_module_config.py
    "zero_optimization.leaf_module.classes": [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    ],
    "zero_optimization.leaf_module.names": [],
    "zero_optimization.leaf_module.name_suffixes": [],
    "activation_checkpointing.partition_activations": False,
    "activation_checkpointing.number_checkpoints": None,
    "comms_logger.enabled": False,
    "comms_logger.prof_all": True,
    "comms_logger.prof_ops": [],
    "checkpoint.tag_validation": "Warn",
    "checkpoint.load_universal": False,
    "data_types.grad_accum_dtype": None,
}


def _lookup(data: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


@pytest.mark.parametrize("path", sorted(DEEPSPEED_CODE_DEFAULTS))
def test_empty_config_has_deepspeeds_code_defaults(path: str) -> None:
    assert _lookup(load_config({}).to_dict(), path) == DEEPSPEED_CODE_DEFAULTS[path]


def test_overlap_comm_default_depends_on_stage() -> None:
    for stage in (0, 1, 2):
        assert load_config({"zero_optimization": {"stage": stage}}).zero_optimization.overlap_comm is False
    assert load_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert (
        load_config({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm is False
    )
    assert ZeroConfig(stage=3).overlap_comm is True and ZeroConfig().overlap_comm is False


def test_scheduler_defaults_are_filled() -> None:
    config = load_config({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})
    assert config.scheduler is not None
    params = dict(config.scheduler.params)
    assert params["cycle_first_step_size"] == 2000 and params["cycle_second_step_size"] is None
    assert params["cycle_momentum"] is True and params["cycle_min_mom"] == 0.8 and params["last_batch_iteration"] == -1


def test_schema_is_valid_draft_2020_12() -> None:
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


SECTIONS: list[tuple[str, type[Any]]] = [
    ("", DeepSpeedConfig),
    ("fp16", FP16Config),
    ("bf16", BF16Config),
    ("zero_optimization", ZeroConfig),
    ("zero_optimization.offload_optimizer", OffloadConfig),
    ("zero_optimization.leaf_module", LeafModuleConfig),
    ("activation_checkpointing", ActivationCheckpointingConfig),
    ("comms_logger", CommsLoggerConfig),
    ("checkpoint", CheckpointConfig),
    ("data_types", DataTypesConfig),
]


def _section_schema(path: str) -> dict[str, Any]:
    node = resolve(load_schema())
    for part in filter(None, path.split(".")):
        node = resolve(node["properties"][part])
    return node


@pytest.mark.parametrize(("path", "cls"), SECTIONS, ids=[p or "top" for p, _ in SECTIONS])
def test_dataclass_fields_mirror_the_schema(path: str, cls: type[Any]) -> None:
    node = _section_schema(path)
    typed = {k for k, v in node["properties"].items() if not resolve(v).get("x-ignored")}
    json_fields = {f.name for f in dataclasses.fields(cls) if f.metadata.get("json", True)}
    if cls is OffloadConfig:  # one class for both offload kinds
        typed |= {k for k, v in _section_schema("zero_optimization.offload_param")["properties"].items()}
    assert json_fields == typed
    instance = cls()
    for name in sorted(json_fields & set(node["properties"])):
        schema_node = resolve(node["properties"][name])
        if "default" not in schema_node or name == "overlap_comm":  # overlap_comm: stage-dependent, tested above
            continue
        value = getattr(instance, name)
        assert (list(value) if isinstance(value, tuple) else value) == schema_node["default"], name


def test_offload_param_defaults_from_schema_differ_only_in_buffer_count() -> None:
    zero = load_config({}).zero_optimization
    assert zero.offload_param.buffer_count == 5 and zero.offload_optimizer.buffer_count == 4
    assert ZeroConfig().offload_param == zero.offload_param
