"""``zero.Init`` with Hugging Face and peft models on 2 ranks: initialisation that runs after a layer is
built (transformers' ``post_init``, peft's adapter init, a custom ``nn.init`` in a parent's ``__init__``)
gives the values of a plain build with the same seed, and ``from_pretrained`` inside ``zero.Init`` (which
builds on the meta device) ends with every loaded weight partitioned and equal to the file.

Every comparison is exact: rank 0's random stream advances as in the plain build and its values are the
ones every rank keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _llama() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,  # far from torch's default init, so a skipped post_init shows
    )
    return transformers.LlamaForCausalLM(cfg)


def _lora(model: Any) -> Any:
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, cfg)


class Custom(nn.Module):
    """Re-initialises its children from its own ``__init__``, after they were built (and partitioned)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 4)
        nn.init.xavier_uniform_(self.a.weight)  # needs two dimensions: fails on a bare placeholder
        nn.init.trunc_normal_(self.b.weight, std=0.3)
        nn.init.zeros_(self.a.bias)
        nn.init.constant_(self.b.bias, 0.25)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from ds_strategy.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _builds(rank: int, world: int, base_dir: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.runtime.zero.init import init_shard

    out: dict[str, Any] = {}
    for name, build in (("llama", _llama), ("lora", lambda: _lora(_llama())), ("custom", Custom)):
        torch.manual_seed(0)
        plain = {k: v.detach().clone() for k, v in build().named_parameters()}
        torch.manual_seed(0)
        with ds_strategy.zero.Init():
            model = build()
        out[name] = (plain, _full(model), max(p.numel() for p in model.parameters()))
    with ds_strategy.zero.Init():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    params = list(loaded.parameters())
    out["pretrained"] = (
        {
            k: v.detach().clone()
            for k, v in transformers.AutoModelForCausalLM.from_pretrained(base_dir).named_parameters()
        },
        _full(loaded),
        sum(init_shard(p) is None for p in params),
    )
    out["init_functions_restored"] = nn.init.zeros_.__module__ == "torch.nn.init"
    return out


@pytest.mark.multiprocess
def test_post_construction_init_and_from_pretrained_under_zero_init(tmp_path: Path) -> None:
    torch.manual_seed(1)
    _llama().save_pretrained(tmp_path / "base", max_shard_size="20KB")
    for r in run_distributed(_builds, world_size=2, args=(str(tmp_path / "base"),), timeout=300):
        for name in ("llama", "lora", "custom"):
            plain, got, at_rest = r[name]
            assert at_rest == 0, name  # really partitioned
            assert plain.keys() == got.keys()
            for k, v in plain.items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"{name}: {k}")
        lora_b = [v for k, v in r["lora"][1].items() if "lora_B" in k]
        assert lora_b and all(not v.any() for v in lora_b)  # peft's zero init reached the partitioned B
        expected, got, whole = r["pretrained"]
        assert whole == 0  # every loaded weight was partitioned on assignment
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"pretrained: {k}")
        assert r["init_functions_restored"]
