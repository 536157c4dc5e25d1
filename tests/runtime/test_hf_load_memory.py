"""Loading Hugging Face weights into a model built under zero.Init holds about this rank's half of the
base on 2 ranks (issue 21, criterion 3: peak RSS below 0.6x the base's size while loading).

tests/runtime/scripts/hf_load_memory.py builds the model from its config under zero.Init (Hugging Face's
initialisation included) and loads the safetensors file with ``load_hf_weights``; it reports the peak RSS
that adds per rank as a multiple of the file's size, with MALLOC_PERTURB_ (every allocation written, as
a device allocator commits it) and a fixed MALLOC_MMAP_THRESHOLD_ (freed blocks returned at once). Here:
a 45M-parameter Llama (182 MB fp32), whose largest weight is 3.5% of it. Measured: 0.56x and 0.58x (the two
ranks) here; 0.57x for a
119M-parameter base of 455 MiB (vocabulary 8000, hidden 1024, 8 layers) with the command in the script's
docstring. The rest above 0.5x is the largest weight built whole before it is partitioned, and reading one
weight's slice.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.launcher.common import torchrun

transformers = pytest.importorskip("transformers")

SCRIPT = Path(__file__).parent / "scripts" / "hf_load_memory.py"


@pytest.mark.multiprocess
def test_load_hf_weights_under_zero_init_holds_about_half_the_base(tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=2000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    env = {**os.environ, "MALLOC_PERTURB_": "165", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun(), str(SCRIPT)]
    proc = subprocess.run(
        [*cmd, str(tmp_path / "base"), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert len(rows) == 2, proc.stdout
    for row in rows:
        assert row["model"] > 150e6
        assert row["ratio"] < 0.6, f"rank {row['rank']}: building and loading added {row['ratio']:.2f}x the base"
