"""ds_strategy: DeepSpeed-class ZeRO training for PyTorch Lightning and plain PyTorch loops."""

from __future__ import annotations

__version__ = "0.1.0"
