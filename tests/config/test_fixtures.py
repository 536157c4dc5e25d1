"""Every config from the seed notes, every example of DeepSpeed's config page and real-world configs load."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from ds_strategy.config import (
    ConfigContext,
    ConfigDeprecationWarning,
    ConfigError,
    DeepSpeedConfig,
    IgnoredConfigWarning,
    load_config,
)

from .helpers import FIXTURES, fixture_files

ALL = fixture_files("seeds") + fixture_files("deepspeed_docs") + fixture_files("real_world")

# Fixtures that ask for something ds_strategy does not build and would otherwise silently ignore (NVMe,
# tensor/expert parallelism ...): loading them is a ConfigError naming exactly these keys (config/support.py).
REFUSED = {
    "deepspeed_docs/bf16": ["bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states"],
    "deepspeed_docs/compile_autosp": ["compile.deepcompile", "compile.passes"],
    "deepspeed_docs/compile_autotp": ["tensor_parallel", "compile.deepcompile", "compile.passes"],
    "deepspeed_docs/data_efficiency": ["data_efficiency"],
    "deepspeed_docs/expert_parallel": ["expert_parallel"],
    "deepspeed_docs/expert_parallel_custom_model": ["expert_parallel"],
    "deepspeed_docs/expert_parallel_preset_override": ["expert_parallel"],
    "deepspeed_docs/tensor_parallel": ["tensor_parallel"],
    "deepspeed_docs/torch_autocast": ["torch_autocast"],
    "real_world/fp16_zero2_sparse_attention": ["sparse_attention"],
}
# Refused by a cross-field rule instead (a partial offload to NVMe): test_docs_offload_examples_load_as_nvme_offload.
CROSS_REFUSED = {"deepspeed_docs/zero_offload_optimizer_nvme"}


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _refused_paths(path: Path, **kwargs: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _load_quietly(path, **kwargs)
    assert all("is not supported by ds_strategy" in p.message for p in info.value.problems), info.value
    return [p.path for p in info.value.problems]


def _load_quietly(path: Path, **kwargs: object) -> DeepSpeedConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(path, **kwargs)  # type: ignore[arg-type]


def test_fixture_groups_are_populated() -> None:
    assert len(fixture_files("seeds")) >= 8
    assert len(fixture_files("deepspeed_docs")) >= 30
    assert len(fixture_files("real_world")) >= 6


@pytest.mark.parametrize("path", ALL, ids=[f"{p.parent.name}/{p.stem}" for p in ALL])
def test_fixture_loads(path: Path) -> None:
    if _name(path) in CROSS_REFUSED:
        return
    if _name(path) in REFUSED:
        assert _refused_paths(path, world_size=2) == REFUSED[_name(path)]
        return
    config = _load_quietly(path, world_size=2)
    assert isinstance(config, DeepSpeedConfig)
    # The typed object survives a JSON round trip unchanged.
    again = _load_quietly(json.loads(json.dumps(config.to_dict())), world_size=2)
    assert again == config


@pytest.mark.parametrize("path", ALL, ids=[f"{p.parent.name}/{p.stem}" for p in ALL])
def test_fixture_resolves_with_a_lightning_like_context(path: Path) -> None:
    if _name(path) in REFUSED or _name(path) in CROSS_REFUSED:
        return  # refused before "auto" resolution matters (test_fixture_loads)
    raw = json.loads(path.read_text())
    context = ConfigContext(micro_batch_size=2, gradient_accumulation_steps=None, source="the Trainer")
    if isinstance(raw.get("train_micro_batch_size_per_gpu"), int) or isinstance(raw.get("train_batch_size"), int):
        context = ConfigContext(source="the Trainer")
    config = _load_quietly(path, world_size=2, context=context)
    assert config.batch.train_batch_size == (
        config.batch.train_micro_batch_size_per_gpu * config.batch.gradient_accumulation_steps * 2
    )


def test_seed_zero2_scientific_numbers_become_ints() -> None:
    zero = _load_quietly(FIXTURES / "seeds" / "seed001_zero2.json").zero_optimization
    assert zero.stage == 2
    assert zero.allgather_bucket_size == 300_000_000 and type(zero.allgather_bucket_size) is int
    assert zero.reduce_bucket_size == 300_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.overlap_comm is True and zero.reduce_scatter is True and zero.contiguous_gradients is True


def test_seed_zero3_auto_sizes_use_defaults_or_hidden_size() -> None:
    path = FIXTURES / "seeds" / "seed001_zero3.json"
    zero = _load_quietly(path).zero_optimization
    assert zero.stage == 3
    assert zero.reduce_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    sized = _load_quietly(path, context=ConfigContext(hidden_size=1024)).zero_optimization
    assert sized.reduce_bucket_size == 1024 * 1024
    assert sized.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert sized.stage3_param_persistence_threshold == 10 * 1024


def test_seed_fp16_string_true_enables_fp16() -> None:
    config = _load_quietly(FIXTURES / "seeds" / "seed001_fp16.json")
    assert config.fp16.enabled is True and config.fp16_enabled
    assert config.fp16.dynamic_loss_scale and config.fp16.initial_scale == 2.0**16
    assert (config.fp16.loss_scale_window, config.fp16.hysteresis, config.fp16.min_loss_scale) == (1000, 2, 1.0)


def test_seed_bf16() -> None:
    config = _load_quietly(FIXTURES / "seeds" / "seed001_bf16.json")
    assert config.bf16_enabled and not config.fp16_enabled


def test_seed002_quickstart_legacy_zero_and_batch() -> None:
    with pytest.warns(ConfigDeprecationWarning, match='"zero_optimization": true is a legacy form'):
        config = load_config(FIXTURES / "seeds" / "seed002_quickstart.json", world_size=2)
    assert config.zero_stage == 1 and config.zero_enabled
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        8,
        4,
        1,
    )
    assert config.optimizer is not None and config.optimizer.type == "Adam"
    assert dict(config.optimizer.params) == {"lr": 0.00015}


def test_docs_offload_examples_load_as_nvme_offload() -> None:
    param = _load_quietly(json.loads((FIXTURES / "deepspeed_docs" / "zero_offload_param_nvme.json").read_text()))
    assert param.zero_optimization.offload_param.device == "nvme"  # type: ignore[union-attr]
    assert param.zero_optimization.offload_param.nvme_path  # type: ignore[union-attr]
    # A partial offload (ratio < 1) is built for "cpu", not for NVMe (runtime/zero/partial_offload.py).
    with pytest.raises(ConfigError, match="a partial offload to NVMe is not built") as info:
        _load_quietly(FIXTURES / "deepspeed_docs" / "zero_offload_optimizer_nvme.json")
    assert [p.path for p in info.value.problems] == ["zero_optimization.offload_optimizer.ratio"]
    raw = json.loads((FIXTURES / "deepspeed_docs" / "zero_offload_optimizer_nvme.json").read_text())
    raw["zero_optimization"]["offload_optimizer"].update(device="cpu")
    assert _load_quietly(raw).zero_optimization.offload_optimizer.ratio == 0.3  # type: ignore[union-attr]
    raw["zero_optimization"]["offload_optimizer"].update(device="cpu", ratio=1.0)
    zero = _load_quietly(raw).zero_optimization  # type: ignore[arg-type]
    assert zero.offload_optimizer.enabled and zero.offload_optimizer.device == "cpu"
    assert not zero.offload_param.enabled


def test_docs_examples_of_unimplemented_sections_warn_they_are_ignored() -> None:
    with pytest.warns(IgnoredConfigWarning, match="tensorboard"):
        config = load_config(FIXTURES / "deepspeed_docs" / "tensorboard.json")
    assert config.ignored["tensorboard"]["job_name"] == "train_bert"
    assert config.to_dict()["tensorboard"] == {
        "enabled": True,
        "output_path": "output/ds_logs/",
        "job_name": "train_bert",
    }


def test_disabled_ignored_sections_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(FIXTURES / "deepspeed_docs" / "flops_profiler.json")
        load_config(FIXTURES / "deepspeed_docs" / "autotuning.json")
        load_config(FIXTURES / "deepspeed_docs" / "checkpoint.json")
        load_config(FIXTURES / "deepspeed_docs" / "fp16.json")


def test_real_world_hf_auto_config_with_trainer_context() -> None:
    context = ConfigContext(
        micro_batch_size=4,
        gradient_accumulation_steps=8,
        gradient_clipping=1.0,
        precision="bf16-mixed",
        optimizer_params={"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
        scheduler_params={"warmup_max_lr": 2e-5, "warmup_num_steps": 100, "total_num_steps": 1000},
        source="the Trainer",
    )
    config = _load_quietly(
        FIXTURES / "real_world" / "hf_zero1_adamw_warmupdecay_auto.json", world_size=4, context=context
    )
    assert config.batch.train_batch_size == 4 * 8 * 4
    assert config.gradient_clipping == 1.0
    assert config.bf16_enabled and not config.fp16_enabled
    assert config.optimizer is not None and config.optimizer.unresolved == ()
    assert config.optimizer.kwargs()["betas"] == [0.9, 0.95]
    assert config.scheduler is not None and config.scheduler.kwargs()["total_num_steps"] == 1000
    assert config.scheduler.params["warmup_type"] == "log"  # default filled in
    assert config.fp16.min_loss_scale == 0.00001
