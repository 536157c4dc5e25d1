"""The MoE run of tests/runtime/moe/test_moe_kill.py, as its own processes (so the test can SIGKILL them).

    python tests/runtime/moe/kill_script.py MODE ROOT OUT

2 ranks (spawned here, gloo through a file store under ROOT). MODE ``train``: steps 1-4 from the start,
saving tag ``A`` after step 2 and tag ``B`` after step 4 (with ``DS_STRATEGY_CKPT_TEST_PAUSE`` set in the
environment only for ``B``'s save when ``KILL_PAUSE`` is given, so the test can kill the save mid-way).
MODE ``resume``: load ``latest`` from ROOT, then steps 3-4. Rank 0 writes the losses (``float.hex``) to OUT.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _rank(rank: int, mode: str, root: str, out: str) -> None:
    torch.set_num_threads(1)
    store = os.path.join(root, f".pg-{mode}")
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=WORLD)
    from tests.runtime.moe.test_moe_kill import SAVE_AT, batches, make_engine, train

    data = batches()
    engine = make_engine(rank, WORLD, seed=0 if mode == "train" else 9)
    if mode == "train":
        losses = train(engine, data[:SAVE_AT], rank, WORLD)
        engine.save_checkpoint(root, tag="A")
        pause = os.environ.get("KILL_PAUSE")
        losses += train(engine, data[SAVE_AT:], rank, WORLD)
        if pause:
            os.environ["DS_STRATEGY_CKPT_TEST_PAUSE"] = pause
        engine.save_checkpoint(root, tag="B")
    else:
        engine.load_checkpoint(root)
        losses = train(engine, data[SAVE_AT:], rank, WORLD)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([x.hex() for x in losses], f)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, root, out = sys.argv[1:4]
    mp.spawn(_rank, args=(mode, root, out), nprocs=WORLD)
