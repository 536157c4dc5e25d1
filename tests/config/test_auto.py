"""Values set to "auto" come from the context; a disagreement is an error or a warning naming the winner."""

from __future__ import annotations

import warnings

import pytest

from ds_strategy.config import ConfigConflictWarning, ConfigContext, ConfigError, load_config

HF_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2},
}


def test_auto_batch_from_context() -> None:
    config = load_config(
        HF_AUTO, context=ConfigContext(micro_batch_size=4, gradient_accumulation_steps=2, world_size=2)
    )
    batch = config.batch
    assert (batch.train_batch_size, batch.train_micro_batch_size_per_gpu, batch.gradient_accumulation_steps) == (
        16,
        4,
        2,
    )
    assert batch.world_size == 2 and config.world_size == 2


def test_auto_without_context_stays_unresolved_then_resolves() -> None:
    config = load_config(HF_AUTO)
    assert not config.batch_resolved and config.gradient_clipping == 1.0
    assert not config.fp16_enabled and not config.bf16_enabled
    with pytest.raises(ConfigError, match="batch sizes are not resolved yet"):
        _ = config.batch
    resolved = load_config(config, context={"micro_batch_size": 8, "world_size": 4, "precision": "bf16-mixed"})
    assert resolved.batch.train_batch_size == 32
    assert resolved.bf16_enabled
    assert load_config(resolved) is resolved  # no new information: returned as is


def test_auto_gradient_clipping_and_precision() -> None:
    ctx = ConfigContext(micro_batch_size=1, gradient_clipping=0.5, precision="16-mixed", world_size=1)
    config = load_config(HF_AUTO, context=ctx)
    assert config.gradient_clipping == 0.5
    assert config.fp16_enabled and not config.bf16_enabled
    config = load_config(HF_AUTO, context=ConfigContext(micro_batch_size=1, precision="32-true", world_size=1))
    assert not config.fp16_enabled and not config.bf16_enabled


def test_absent_values_are_filled_from_context_like_auto() -> None:
    ctx = ConfigContext(
        micro_batch_size=2, gradient_accumulation_steps=3, gradient_clipping=1.0, precision="bf16-mixed"
    )
    config = load_config({"zero_optimization": {"stage": 3}}, world_size=2, context=ctx)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        12,
        2,
        3,
    )
    assert config.gradient_clipping == 1.0 and config.bf16_enabled


def test_agreeing_explicit_values_are_fine() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    ctx = ConfigContext(micro_batch_size=4, gradient_accumulation_steps=2, gradient_clipping=1.0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(config, context=ctx).train_batch_size == 8


def test_conflict_is_an_error_by_default_and_names_both_values() -> None:
    config = {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}
    ctx = ConfigContext(gradient_accumulation_steps=2, gradient_clipping=0.5, world_size=1, source="the Trainer")
    with pytest.raises(ConfigError) as info:
        load_config(config, context=ctx)
    problems = {p.path: p.message for p in info.value.problems}
    assert problems["gradient_accumulation_steps"].startswith(
        "the config says 4 but the Trainer says 2 (gradient_accumulation_steps). "
        'Set it to "auto" (or remove it) to use the Trainer\'s value'
    )
    assert problems["gradient_clipping"].startswith("the config says 1.0 but the Trainer says 0.5")


def test_conflict_prefer_context_warns_which_value_wins() -> None:
    config = {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2}
    ctx = ConfigContext(gradient_accumulation_steps=2, world_size=1, on_conflict="prefer_context", source="the Trainer")
    with pytest.warns(ConfigConflictWarning, match=r"using the Trainer's value 2 \(on_conflict='prefer_context'\)"):
        result = load_config(config, context=ctx)
    assert result.gradient_accumulation_steps == 2 and result.train_batch_size == 4


def test_conflict_prefer_config_warns_which_value_wins() -> None:
    config = {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2}
    ctx = ConfigContext(gradient_accumulation_steps=2, world_size=1, on_conflict="prefer_config")
    with pytest.warns(ConfigConflictWarning, match=r"using the config value 4 \(on_conflict='prefer_config'\)"):
        result = load_config(config, context=ctx)
    assert result.gradient_accumulation_steps == 4 and result.train_batch_size == 8


def test_precision_conflict() -> None:
    config = {"fp16": {"enabled": True}}
    with pytest.raises(
        ConfigError,
        match=r"fp16.enabled: the config selects fp16 \(fp16.enabled=true\) but the "
        r"context says precision='bf16-mixed' \(bf16\)",
    ):
        load_config(config, context=ConfigContext(precision="bf16-mixed"))
    with pytest.warns(ConfigConflictWarning, match="using the context's bf16"):
        result = load_config(config, context=ConfigContext(precision="bf16-mixed", on_conflict="prefer_context"))
    assert result.bf16_enabled and not result.fp16_enabled
    with pytest.warns(ConfigConflictWarning, match="using the config's fp16"):
        result = load_config(config, context=ConfigContext(precision="bf16-mixed", on_conflict="prefer_config"))
    assert result.fp16_enabled and not result.bf16_enabled
    with pytest.raises(ConfigError, match=r"bf16.enabled: the config selects fp32 \(bf16.enabled=false\)"):
        load_config({"bf16": {"enabled": False}}, context=ConfigContext(precision="bf16-true"))


def test_world_size_argument_and_context_must_agree() -> None:
    with pytest.raises(ConfigError, match=r"world_size: load_config\(world_size=2\) disagrees with the context"):
        load_config({}, world_size=2, context=ConfigContext(world_size=4))


def test_optimizer_and_scheduler_auto_params() -> None:
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1, "betas": "auto"}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
    }
    partial = load_config(config)
    assert partial.optimizer is not None and partial.optimizer.unresolved == ("lr", "betas")
    assert partial.scheduler is not None and set(partial.scheduler.unresolved) == {
        "total_num_steps",
        "warmup_num_steps",
    }
    with pytest.raises(ConfigError) as info:
        partial.optimizer.kwargs()
    assert [str(p) for p in info.value.problems] == [
        'optimizer.params.lr: is "auto" and nothing resolved it; give a value in the config or pass '
        "optimizer_params={'lr': ...} in the context",
        'optimizer.params.betas: is "auto" and nothing resolved it; give a value in the config or pass '
        "optimizer_params={'betas': ...} in the context",
    ]
    ctx = ConfigContext(
        optimizer_params={"lr": 3e-4, "betas": (0.9, 0.95)},
        scheduler_params={"total_num_steps": 1000, "warmup_num_steps": 10},
    )
    full = load_config(partial, context=ctx)
    assert full.optimizer is not None and full.optimizer.kwargs() == {
        "lr": 3e-4,
        "weight_decay": 0.1,
        "betas": [0.9, 0.95],
    }
    assert full.scheduler is not None and full.scheduler.kwargs()["total_num_steps"] == 1000
    with pytest.raises(
        ConfigError, match=r"optimizer.params.weight_decay: the config says 0.1 but the context says 0.0"
    ):
        load_config(config, context=ConfigContext(optimizer_params={"weight_decay": 0.0}))


def test_hidden_size_resolves_zero_buckets_only_when_auto() -> None:
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 123}}
    zero = load_config(config, context=ConfigContext(hidden_size=100)).zero_optimization
    assert zero.reduce_bucket_size == 10_000
    assert zero.stage3_prefetch_bucket_size == 123
    assert zero.stage3_param_persistence_threshold == 100_000  # absent: the default, not 10 * hidden_size


def test_context_from_mapping_and_precision_spellings() -> None:
    for flag, fp16, bf16 in [
        (16, True, False),
        ("16-true", True, False),
        ("bf16", False, True),
        ("64-true", False, False),
    ]:
        config = load_config({"fp16": {"enabled": "auto"}}, context={"precision": flag})
        assert (config.fp16_enabled, config.bf16_enabled) == (fp16, bf16)
