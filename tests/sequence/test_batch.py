"""``shard_batch`` / ``ShardedSequenceLoader``: padding, positions, targets across shard boundaries, and the
normaliser, checked value by value on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.sequence import ShardedSequenceLoader, shard_batch
from tests.harness import run_distributed
from tests.sequence.common import layout


def _body(rank: int, world: int) -> dict[str, object]:
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    labels = ids.clone()
    labels[0, 0] = labels[1, 4] = -100
    batch = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
        "token_type_ids": ids * 10,  # another [B, S] tensor: padded with 0 and cut
        "meta": "kept",
        "pixel_count": torch.tensor([3, 4]),  # not [B, S]: passed through
    }
    out: dict[str, object] = {}
    with layout(world) as groups:
        got = shard_batch(batch, pad_token_id=7)
        out["keys"] = sorted(got)
        out.update({k: got[k].tolist() for k in ("input_ids", "labels", "shift_labels", "position_ids")})
        out["token_type_ids"] = got["token_type_ids"].tolist()
        out["num_items"] = float(got["num_items_in_batch"])
        out["passed"] = (got["meta"], got["pixel_count"].tolist())
        positioned = shard_batch({"input_ids": ids, "position_ids": torch.arange(10, 15)}, groups)
        out["positions_continued"] = positioned["position_ids"].tolist()
        out["no_labels"] = sorted(positioned)
        loader = ShardedSequenceLoader([batch, batch], pad_token_id=7)
        out["loader"] = (len(loader), [b["input_ids"].tolist() for b in loader])
    return out


def test_shard_batch_values() -> None:
    r0, r1 = run_distributed(_body, world_size=2)
    keys = ["input_ids", "labels", "meta", "num_items_in_batch", "pixel_count", "position_ids", "shift_labels"]
    assert r0["keys"] == r1["keys"] == sorted([*keys, "token_type_ids"])  # attention_mask dropped
    # 5 tokens padded to 6 (pad_token_id 7), 3 per rank
    assert r0["input_ids"] == [[11, 12, 13], [21, 22, 23]] and r1["input_ids"] == [[14, 15, 7], [24, 25, 7]]
    assert r0["labels"] == [[-100, 12, 13], [21, 22, 23]] and r1["labels"] == [[14, 15, -100], [24, -100, -100]]
    # the target of rank 0's last token is rank 1's first label (shifted over the whole sequence)
    assert r0["shift_labels"] == [[12, 13, 14], [22, 23, 24]]
    assert r1["shift_labels"] == [[15, -100, -100], [-100, -100, -100]]
    assert r0["position_ids"] == [[0, 1, 2], [0, 1, 2]] and r1["position_ids"] == [[3, 4, 5], [3, 4, 5]]
    assert r0["token_type_ids"] == [[110, 120, 130], [210, 220, 230]] and r1["token_type_ids"][1] == [240, 250, 0]
    # 7 valid targets in all, 2 ranks: ForCausalLMLoss's sum / (7 / 2) is 2 x local sum / 7
    assert r0["num_items"] == r1["num_items"] == 3.5
    assert r0["passed"] == r1["passed"] == ("kept", [3, 4])
    assert r0["positions_continued"] == [[10, 11, 12], [10, 11, 12]] and r1["positions_continued"][0] == [13, 14, 15]
    assert "shift_labels" not in r0["no_labels"] and "num_items_in_batch" not in r0["no_labels"]
    assert r1["loader"] == (2, [[[14, 15, 7], [24, 25, 7]]] * 2)


def test_needs_a_layout() -> None:
    with pytest.raises(RuntimeError, match="shard_batch: no sequence-parallel layout"):
        shard_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
