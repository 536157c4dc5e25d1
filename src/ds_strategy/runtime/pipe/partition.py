"""Cutting a list of layers into contiguous pipeline stages (DeepSpeed's partition methods).

``parts`` is a list of ``num_stages + 1`` boundaries: stage s owns layers ``[parts[s], parts[s + 1])``.

- ``"uniform"``: equal layer counts; the first ``len % num_stages`` stages take one layer more.
- ``"parameters"``: balance the trainable parameter counts.
- ``"type:<regex>"``: balance the number of layers whose class name matches the regex (case-insensitive).

The balanced split solves the linear partition problem with the same objective as DeepSpeed's
``partition_balanced``: among contiguous splits, the smallest spread ``max(part) - min(part)`` of the part
weights, the later cut winning a tie, so both libraries place the same layers on the same stage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` near-equal contiguous parts of ``num_items`` items."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``weights`` with the smallest max-min spread."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[i][j]: (cost, largest part, smallest part) of the first i items cut into j parts; cut[i][j]: last cut.
    big = [[inf] * (m + 1) for _ in range(n + 1)]
    small = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    big[0][0] = 0.0
    cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi = max(big[k][j - 1], part)
                lo = min(small[k][j - 1], part)
                c = hi - lo
                if cost[i][j] >= c:  # a tie goes to the later cut
                    cost[i][j], big[i][j], small[i][j], cut[i][j] = c, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    parts.reverse()
    return parts


def type_weights(names: Sequence[str | None], pattern: str) -> list[int]:
    """1 for each layer whose class name matches ``pattern`` (case-insensitive search), else 0."""
    regex = re.compile(pattern, re.IGNORECASE)
    weights = [1 if name is not None and regex.search(name) else 0 for name in names]
    if not any(weights):
        known = sorted({n for n in names if n is not None})
        raise ValueError(f"partition_method 'type:{pattern}' matches no layer; the layer class names are {known}")
    return weights
