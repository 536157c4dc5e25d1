"""ZeroStrategy without training: names, constructor, precision mapping, config merging, launcher choice.

These build Trainers (no processes start until fit) and resolve configs in the test process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

import ds_strategy.lightning as zl
from ds_strategy.config import ConfigConflictWarning, ConfigError
from ds_strategy.lightning import core as core_module  # where "auto" is decided for both faces
from ds_strategy.lightning import process as process_module  # the process-group setup both faces share
from ds_strategy.lightning.config import apply_keywords, read_config, resolve
from ds_strategy.lightning.launcher import ZeroMultiProcessingLauncher

NAMES = ["zero0", "zero1", "zero1_offload", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_offload_nvme"]


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, logger=False, **kwargs)


# ---------------------------------------------------------------------- names
def test_import_registers_every_name_idempotently() -> None:
    assert zl.register_strategies() == NAMES  # a second registration (the import did the first) is fine
    for name in NAMES:
        assert StrategyRegistry[name]["strategy"] is zl.ZeroStrategy


def test_a_foreign_name_is_never_taken_over() -> None:
    registry = _StrategyRegistry()
    registry.register("zero2", pl.strategies.DDPStrategy)
    with pytest.raises(ValueError, match="'zero2' is already registered by lightning"):
        zl.register_strategies(registry)


@pytest.mark.parametrize("name", NAMES)
def test_names_build_the_strategy(name: str) -> None:
    strategy = _trainer(strategy=name).strategy
    assert isinstance(strategy, zl.ZeroStrategy)
    assert strategy.stage == int(name[4]) and strategy.is_distributed
    zero = strategy.raw_config["zero_optimization"]
    assert ("offload_optimizer" in zero) == ("offload" in name)
    assert ("offload_param" in zero) == name.startswith("zero3_offload")
    if name.endswith("nvme"):  # Lightning's deepspeed_stage_3_offload_nvme: both blocks in swap files
        for block in ("offload_optimizer", "offload_param"):
            assert zero[block] == {"device": "nvme", "nvme_path": "/local_nvme"}


def test_nvme_keywords_as_lightning_takes_them() -> None:
    s = zl.ZeroStrategy(stage=2, offload_optimizer_device="nvme", nvme_path="/fast")
    assert s.raw_config["zero_optimization"]["offload_optimizer"] == {"device": "nvme", "nvme_path": "/fast"}
    assert "offload_param" not in s.raw_config["zero_optimization"]
    with pytest.raises(ValueError, match="contradicts offload_optimizer=False"):
        zl.ZeroStrategy(offload_optimizer=False, offload_optimizer_device="nvme", nvme_path="/x")
    with pytest.raises(ValueError, match="nothing is offloaded to NVMe"):
        zl.ZeroStrategy(nvme_path="/x")
    with pytest.raises(ValueError, match=r"contradicts the config's zero_optimization\.offload_param\.device='cpu'"):
        zl.ZeroStrategy(
            stage=3,
            offload_params_device="nvme",
            nvme_path="/x",
            config={"zero_optimization": {"offload_param": {"device": "cpu"}}},
        )


def test_instance_and_name_are_the_same_strategy() -> None:
    by_instance = _trainer(strategy=zl.ZeroStrategy(stage=3))
    by_name = _trainer(strategy="zero3")
    for trainer in (by_instance, by_name):
        assert trainer.strategy.stage == 3
        assert trainer._accelerator_connector.is_distributed
        assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert by_instance.strategy.raw_config == by_name.strategy.raw_config


# ---------------------------------------------------------------------- constructor and config
def test_keywords_land_in_the_config() -> None:
    s = zl.ZeroStrategy(stage=1, offload_optimizer=True, reduce_bucket_size=1000, loss_scale=128, micro_batch_size=4)
    assert s.raw_config == {
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 1000},
        "fp16": {"loss_scale": 128},
        "train_micro_batch_size_per_gpu": 4,
    }
    assert zl.ZeroStrategy().stage == 2  # neither keyword nor config: stage 2
    assert zl.ZeroStrategy(config={"zero_optimization": {"stage": 1}}).stage == 1


def test_a_contradicting_keyword_names_both(tmp_path: Path) -> None:
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "reduce_bucket_size": 5e8}}
    with pytest.raises(ValueError) as info:
        zl.ZeroStrategy(stage=3, offload_optimizer=True, reduce_bucket_size=1000, config=config)
    message = str(info.value)
    assert "ZeroStrategy(stage=3) contradicts the config's zero_optimization.stage=2" in message
    assert (
        "ZeroStrategy(offload_optimizer=True) contradicts the config's zero_optimization.offload_optimizer" in message
    )
    assert (
        "ZeroStrategy(reduce_bucket_size=1000) contradicts the config's zero_optimization.reduce_bucket_size" in message
    )
    # Agreeing values (numerically equal, "auto") are fine.
    apply_keywords(
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}, _keywords(reduce_bucket_size=500_000_000)
    )
    apply_keywords({"zero_optimization": {"stage": "auto"}}, _keywords(stage=3))


def _keywords(**kw: Any) -> Any:
    from ds_strategy.lightning.config import StrategyKeywords

    return StrategyKeywords(**kw)


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}))
    assert zl.ZeroStrategy(config=str(path)).raw_config["gradient_clipping"] == 1.0
    assert read_config(path) == {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}
    with pytest.raises(FileNotFoundError, match="no such DeepSpeed config file"):
        zl.ZeroStrategy(config=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="is not valid JSON"):
        zl.ZeroStrategy(config=str(tmp_path / "bad.json"))


def _resolve(raw: dict[str, Any], precision: str = "32-true", **kw: Any) -> Any:
    args: dict[str, Any] = {"micro_batch_size": 4, "accumulate_grad_batches": 1, "gradient_clip_val": None}
    args.update(kw)
    return resolve(raw, world_size=2, precision=precision, **args)


def test_trainer_values_fill_the_config() -> None:
    cfg = _resolve({"zero_optimization": {"stage": 2}}, accumulate_grad_batches=3, gradient_clip_val=0.5)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 3, 24)
    assert cfg.gradient_clipping == 0.5


def test_a_contradicting_trainer_value_names_both() -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(
            {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0},
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
        )
    message = str(info.value)
    assert "gradient_accumulation_steps: the config says 4 but the Trainer says 2" in message
    assert "gradient_clipping: the config says 1.0 but the Trainer says 0.5" in message


@pytest.mark.parametrize(("policy", "winner"), [("prefer_config", (4, 1.0)), ("prefer_context", (2, 0.5))])
def test_on_conflict_picks_a_winner_with_a_warning(policy: str, winner: tuple[int, float]) -> None:
    raw = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0}
    strategy = zl.ZeroStrategy(config=raw, on_conflict=policy)  # type: ignore[arg-type]
    trainer = _trainer(strategy=strategy, accumulate_grad_batches=2, gradient_clip_val=0.5)
    with pytest.warns(ConfigConflictWarning, match=f"on_conflict='{policy}'"):
        cfg = strategy._resolve_config(trainer, fitting=True)
    assert (cfg.gradient_accumulation_steps, cfg.gradient_clipping) == winner


def test_on_conflict_defaults_to_an_error_and_refuses_other_values() -> None:
    raw = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}
    strategy = zl.ZeroStrategy(config=raw)
    with pytest.raises(ConfigError, match=r"gradient_clipping: the config says 1\.0 but the Trainer says 0\.5"):
        strategy._resolve_config(_trainer(strategy=strategy, gradient_clip_val=0.5), fitting=True)
    with pytest.raises(ValueError, match=r"ZeroStrategy\(on_conflict='prefer_trainer'\): use 'error', 'prefer_config'"):
        zl.ZeroStrategy(on_conflict="prefer_trainer")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- precision
@pytest.mark.parametrize(
    ("flag", "dtype"),
    [
        ("32-true", torch.float32),
        ("bf16-mixed", torch.bfloat16),
        ("bf16-true", torch.bfloat16),
        ("16-true", torch.float16),
    ],
)
def test_precision_flags_map_onto_the_engine(flag: str, dtype: torch.dtype) -> None:
    plugin = _trainer(strategy="zero2", precision=flag).strategy.precision_plugin
    assert isinstance(plugin, zl.ZeroPrecision) and plugin.precision == flag and plugin.dtype == dtype
    cfg = _resolve({"fp16": {"initial_scale_power": 5}}, precision=flag)
    assert cfg.precision_dtype == dtype
    if dtype == torch.float16:
        assert cfg.fp16.enabled and cfg.fp16.initial_scale_power == 5  # loss scaling from the config


def test_fp16_mixed_on_cpu() -> None:
    # Lightning itself turns precision="16-mixed" on CPU into "bf16-mixed" (with a warning) before any
    # strategy sees it; fp16 on CPU is reached with "16-true" or our plugin.
    with pytest.warns(UserWarning, match="bf16-mixed"):
        assert _trainer(strategy="zero2", precision="16-mixed").strategy.precision_plugin.precision == "bf16-mixed"
    trainer = _trainer(strategy="zero2", plugins=[zl.ZeroPrecision("16-mixed")])
    assert trainer.strategy.precision_plugin.precision == "16-mixed"


def test_no_amp_scaler_and_unsupported_precision() -> None:
    plugin = _trainer(strategy="zero2", precision="bf16-mixed").strategy.precision_plugin
    assert not hasattr(plugin, "scaler")  # Lightning's MixedPrecision was replaced, not wrapped
    with pytest.raises(TypeError, match="ZeroStrategy does not support 64-bit"):
        _trainer(strategy="zero2", precision="64-true")
    with pytest.raises(ValueError, match="does not support precision='transformer-engine'"):
        zl.ZeroPrecision("transformer-engine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bf16\.enabled"):
        _resolve({"bf16": {"enabled": True}}, precision="32-true")


# ---------------------------------------------------------------------- launching
def test_script_launches_with_popen_notebooks_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(_trainer(strategy="zero2").strategy.launcher, _SubprocessScriptLauncher)
    monkeypatch.setattr(core_module, "_IS_INTERACTIVE", True)  # where "auto" is decided for both faces
    launcher = _trainer(strategy="zero2").strategy.launcher
    assert isinstance(launcher, ZeroMultiProcessingLauncher) and launcher.is_interactive_compatible


@pytest.mark.parametrize(
    "code",
    [
        "import ds_strategy\nassert 'torch' not in sys.modules\nimport lightning as L\n",
        "import ds_strategy\nfrom lightning.pytorch import Trainer\n",
        "import lightning.pytorch as pl\nimport ds_strategy\n",
    ],
    ids=["ds_strategy-then-lightning", "ds_strategy-then-from-import", "lightning-then-ds_strategy"],
)
def test_import_ds_strategy_registers_the_names_in_any_import_order(code: str) -> None:
    # `import ds_strategy` stays free of torch and Lightning, yet Trainer(strategy="zero2") must work
    # whichever of the two a script imports first.
    import subprocess
    import sys

    check = (
        "import sys\n" + code + "from lightning.pytorch import Trainer\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from ds_strategy.lightning import ZeroStrategy\n"
        "assert all(n in StrategyRegistry for n in ('zero0', 'zero2', 'zero3_offload')), list(StrategyRegistry)\n"
        "t = Trainer(strategy='zero2', accelerator='cpu', devices=1, logger=False, enable_checkpointing=False)\n"
        "assert isinstance(t.strategy, ZeroStrategy), type(t.strategy)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize(("initialised", "timeout", "passed"), [(False, None, "default"), (True, None, None),
                                                                  (True, 60, 60)])  # fmt: skip
def test_a_reused_process_group_gets_no_default_timeout(
    monkeypatch: pytest.MonkeyPatch, initialised: bool, timeout: int | None, passed: object
) -> None:
    """A second fit in one process reuses the group: only a timeout the user chose is passed on (and warned
    about by init_distributed), not Lightning's default."""
    from datetime import timedelta

    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.plugins.environments import LightningEnvironment

    seen: dict[str, object] = {}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the strategy writes both: restored after the test
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(process_module, "init_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: initialised)
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    strategy = zl.ZeroStrategy(stage=2, cluster_environment=LightningEnvironment(), **kwargs)
    strategy._process_group_backend = "gloo"
    strategy.setup_distributed()
    want = {"default": default_pg_timeout, None: None}.get(passed, timedelta(seconds=60))  # type: ignore[arg-type]
    assert seen["timeout"] == want


def test_a_bad_config_fails_at_construction_before_any_process_starts() -> None:
    """The merged config is checked in __init__: an unknown key, a wrong type or a refused setting raises
    there (once, in the launching process); "auto" entries wait for the Trainer's values at setup."""
    with pytest.raises(ConfigError, match=r"zero_optimization\.bogus: unknown key"):
        zl.ZeroStrategy(stage=2, config={"zero_optimization": {"bogus": 1}})
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path: .*nvme_path is null"):
        zl.ZeroStrategy(stage=2, config={"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(ConfigError, match="gradient_clipping"):
        zl.ZeroStrategy(config={"gradient_clipping": "a lot"})
    ok = zl.ZeroStrategy(config={"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}})
    assert ok.stage == 2


def test_both_faces_hold_one_kind_of_core_built_alike() -> None:
    """The Trainer's and Fabric's strategies each hold a ``ZeroCore`` (core.py), built alike from the same
    keywords: the same raw config and stage, the same conflict policy; errors name the face."""
    from ds_strategy.lightning.core import ZeroCore

    kw: dict[str, Any] = {
        "stage": 3,
        "offload_optimizer": True,
        "config": {"gradient_clipping": 1.0},
        "on_conflict": "prefer_config",
        "start_method": "popen",
    }
    trainer_face, fabric_face = zl.ZeroStrategy(**kw), zl.ZeroFabricStrategy(**kw)
    assert type(trainer_face.core) is ZeroCore and type(fabric_face.core) is ZeroCore
    assert trainer_face.raw_config == fabric_face.raw_config
    assert trainer_face.raw_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert trainer_face.stage == fabric_face.stage == 3
    assert trainer_face.core.on_conflict == fabric_face.core.on_conflict == "prefer_config"
    assert trainer_face.core.start_method == fabric_face.core.start_method == "popen"
    with pytest.raises(ValueError, match=r"^ZeroFabricStrategy\(stage=5\)"):
        zl.ZeroFabricStrategy(stage=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^ZeroStrategy\(stage=5\)"):
        zl.ZeroStrategy(stage=5)  # type: ignore[arg-type]
