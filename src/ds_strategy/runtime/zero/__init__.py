"""ZeRO stages 0-3 behind one interface (``ZeroStage``), built on the flat layout of ``runtime.layout``."""

from __future__ import annotations

from .base import StageOptions, ZeroStage
from .collectives import Collectives
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3

STAGES: dict[int, type[ZeroStage]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}

__all__ = ["STAGES", "Collectives", "Stage0", "Stage1", "Stage2", "Stage3", "StageOptions", "ZeroStage"]
