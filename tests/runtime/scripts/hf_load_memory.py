"""Peak host memory, per rank, of building a Hugging Face model under zero.Init and loading its
safetensors weights with ``load_hf_weights``, as a multiple of the weights' size on disk.

    MALLOC_PERTURB_=165 python -m torch.distributed.run --nproc_per_node 2 hf_load_memory.py BASE_DIR [ROWS]

BASE_DIR holds ``config.json`` and the weights (``save_pretrained``). VmHWM is reset after the imports (and a
throwaway 8-wide build of the same architecture, which imports its modeling code);
then the model is built under ``zero.Init`` (Hugging Face's initialisation included) and loaded. Prints one
JSON line per rank: {"rank", "added", "model", "ratio"}, and writes it to ROWS/rank<N>.json when given.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
import transformers

import ds_strategy
from ds_strategy.accelerator.cpu import process_memory, reset_peak_rss
from ds_strategy.utils import load_hf_weights


def main() -> None:
    base = Path(sys.argv[1])
    ds_strategy.init_distributed()
    config = transformers.AutoConfig.from_pretrained(base)
    transformers.AutoModelForCausalLM.from_config(
        config.__class__(num_hidden_layers=1, vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1)
    )
    model_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    dist.barrier()
    reset_peak_rss()
    before, _ = process_memory()
    with ds_strategy.zero.Init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    load_hf_weights(model, base)
    _, peak = process_memory()
    added = (peak or before) - before
    assert max(p.numel() for p in model.parameters()) == 0  # partitioned
    line = json.dumps({"rank": dist.get_rank(), "added": added, "model": model_bytes, "ratio": added / model_bytes})
    print(line, flush=True)
    if len(sys.argv) > 2:
        Path(sys.argv[2], f"rank{dist.get_rank()}.json").write_text(line)
    dist.barrier()


if __name__ == "__main__":
    main()
