"""The typed result: frozen, hashable, convenient, round-trippable; inputs as dict, path, JSON text or object."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from ds_strategy.config import (
    ConfigError,
    DeepSpeedConfig,
    FrozenDict,
    OptimizerConfig,
    ZeroConfig,
    load_config,
)

FULL = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]},
}


def test_frozen_and_hashable() -> None:
    config = load_config(FULL, world_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gradient_clipping = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero_optimization.stage = 1  # type: ignore[misc]
    assert isinstance(config.optimizer, OptimizerConfig) and isinstance(config.optimizer.params, FrozenDict)
    with pytest.raises(TypeError):
        config.optimizer.params["lr"] = 1.0  # type: ignore[index]
    assert config.optimizer.params["betas"] == (0.9, 0.95)
    assert config.comms_logger.prof_ops == ("all_reduce",)
    assert hash(config) == hash(load_config(FULL, world_size=4))
    assert {config: 1}[load_config(FULL, world_size=4)] == 1


def test_convenience_properties() -> None:
    config = load_config(FULL, world_size=4)
    assert config.zero_enabled and config.zero_stage == 3
    assert config.bf16_enabled and not config.fp16_enabled
    assert config.zero_optimization.offload_optimizer.enabled and not config.zero_optimization.offload_param.enabled
    assert config.batch.train_micro_batch_size_per_gpu == 8
    assert config.optimizer is not None and config.optimizer.implemented
    assert config.checkpoint.tag_validation_enabled and not config.checkpoint.tag_validation_fail


def test_precision_dtype() -> None:
    import torch

    assert load_config({"bf16": {"enabled": True}}).precision_dtype == torch.bfloat16
    assert load_config({"fp16": {"enabled": True}}).precision_dtype == torch.float16
    assert load_config({}).precision_dtype == torch.float32


def test_importing_the_config_package_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, ds_strategy.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_to_dict_round_trips_and_is_json() -> None:
    config = load_config(FULL, world_size=4)
    data = config.to_dict()
    json.dumps(data)
    assert load_config(data, world_size=4) == config
    assert data["zero_optimization"]["offload_param"] == {
        "device": "none",
        "nvme_path": None,
        "pin_memory": False,
        "buffer_count": 5,
        "buffer_size": 100_000_000,
        "max_in_cpu": 1_000_000_000,
    }
    assert "world_size" not in data and "ignored" not in data


def test_accepts_path_str_and_json_text(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(FULL))
    expected = load_config(FULL, world_size=4)
    assert load_config(path, world_size=4) == expected
    assert load_config(str(path), world_size=4) == expected
    assert load_config(json.dumps(FULL), world_size=4) == expected


def test_direct_construction_is_validated() -> None:
    assert DeepSpeedConfig().zero_stage == 0
    with pytest.raises(ConfigError, match=re.escape("zero_optimization.stage: got 5")):
        ZeroConfig(stage=5)
    with pytest.raises(ConfigError, match="enable at most one"):
        load_config({}).__class__(
            fp16=load_config({"fp16": {"enabled": True}}).fp16, bf16=load_config({"bf16": {"enabled": True}}).bf16
        )
    with pytest.raises(ConfigError, match=r"32 != 4 \* 2 \* 2 = 16"):
        DeepSpeedConfig(
            train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, world_size=2
        )


def test_reresolving_keeps_the_original_autos() -> None:
    config = load_config(
        {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"},
        context={"micro_batch_size": 2, "gradient_clipping": 0.3, "world_size": 2},
    )
    assert (config.train_batch_size, config.gradient_clipping) == (4, 0.3)
    again = load_config(config, context={"micro_batch_size": 5, "world_size": 1})
    assert (again.train_batch_size, again.gradient_clipping) == (5, 1.0)  # the default
    assert load_config(config, world_size=3).train_batch_size == 6  # keeps the earlier context
