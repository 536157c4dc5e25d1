"""Benchmarks against peers (torch DDP / FSDP2 / fused optimizers, DeepSpeed when installed)."""

import os

# Every benchmark here measures CPU training: DeepSpeed must pick its CPU accelerator, and it reads this
# once, at its first import (in the benchmark processes and the ranks they spawn, which inherit it).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
