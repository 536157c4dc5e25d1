"""The divergence check's log folds fetches beyond its capacity into the last slot on the host
([Note: the device log]): the same int64 arithmetic, wrap-around included, that the device would do."""

from __future__ import annotations

import torch

from ds_strategy.runtime.zero.divergence import _FOLD, INDEX_BITS, _wrap64


def test_host_folding_is_int64_arithmetic() -> None:
    value = torch.tensor(0, dtype=torch.int64)
    host = 0
    for seq in range(1, 400):  # long enough to wrap around many times
        code = seq << INDEX_BITS | (seq % 97 + 2)
        value.mul_(_FOLD).add_(code)
        host = _wrap64(host * _FOLD + code)
        assert host == int(value), seq
    assert _wrap64((1 << 63) - 1) == (1 << 63) - 1 and _wrap64(1 << 63) == -(1 << 63)
