"""Peak host memory that building a stage-3 engine adds, per rank, as a multiple of the full model size.

    MALLOC_PERTURB_=165 python -m torch.distributed.run --nproc_per_node 2 stage3_build_memory.py LAYERS WIDTH [ROWS]

The model (LAYERS x Linear(WIDTH, WIDTH), fp32) is built under zero.Init; then VmHWM is reset and
initialize() builds a stage-3 engine with a stateless torch SGD. MALLOC_PERTURB_ makes glibc write every
allocation, as a device allocator commits it (an untouched CPU allocation costs nothing and would hide a
full-size buffer). Prints one JSON line per rank: {"rank", "added", "model", "ratio"}, and writes it to
ROWS/rank<N>.json when ROWS is given (the ranks' stdout lines can interleave).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ds_strategy
from ds_strategy.accelerator.cpu import process_memory, reset_peak_rss


def main() -> None:
    layers, width = int(sys.argv[1]), int(sys.argv[2])
    ds_strategy.init_distributed()
    with ds_strategy.zero.Init():
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model_bytes = layers * width * width * 4
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: no optimizer state to count
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    dist.barrier()
    reset_peak_rss()
    before, _ = process_memory()
    _engine, *_ = ds_strategy.initialize(model=model, optimizer=opt, config=cfg)  # kept alive until the end
    _, peak = process_memory()
    added = (peak or before) - before
    line = json.dumps({"rank": dist.get_rank(), "added": added, "model": model_bytes, "ratio": added / model_bytes})
    print(line, flush=True)
    if len(sys.argv) > 3:
        Path(sys.argv[3], f"rank{dist.get_rank()}.json").write_text(line)
    dist.barrier()


if __name__ == "__main__":
    main()
