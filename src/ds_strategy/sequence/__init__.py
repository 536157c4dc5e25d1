"""``ds_strategy.sequence``: Ulysses sequence parallelism (DeepSpeed-Ulysses and its Hugging Face recipe, ALST).

P ranks (a sequence-parallel group) hold one sequence between them, ``S / P`` tokens each; around attention
an all-to-all trades the sequence shard for a head shard, so each rank attends over the whole sequence for
``heads / P`` heads. Activations per rank shrink by P. docs/sequence_parallel.md has the details.

A Hugging Face causal LM, without the engine (the engine does steps 2 and 6 itself when
``sequence_parallel_size`` is set in its config)::

    import transformers
    from ds_strategy import sequence

    sequence.register()                                            # 1. attn_implementation "ds_ulysses"
    groups = sequence.SequenceGroups.build(2)                      # 2. SP groups of 2 ranks (a collective)
    sequence.set_active(groups)                                    #    the attention function reads this
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="ds_ulysses")
    for batch in sequence.ShardedSequenceLoader(loader):           # 3. this rank's slice of each sequence
        loss = model(**batch).loss                                 # 4. exact token mean x P (see batch.py)
        loss.backward()                                            # 5. then average gradients over all ranks
    groups.close()                                                 # 6. destroys the groups it made

Layer 3 (beside ``runtime/``): it uses torch and ``ds_strategy.comm`` only, so the engine
can build on it and our own modules can use ``DistributedAttention`` and ``sequence_loss`` without it.

- ``SequenceGroups.build(sequence_parallel_size, group=None)``, ``set_active``, ``active_groups``: the layout.
- ``seq_all_to_all(x, group, scatter_idx, gather_idx)``: the differentiable exchange;
  ``seq_all_to_all_many(xs, ...)``: several tensors in one exchange (query, key and value).
- ``DistributedAttention(local_attention, sequence_process_group=None, scatter_idx=2, gather_idx=0)``.
- ``register(name="ds_ulysses", core="sdpa")``: the transformers attention function.
- ``shard_batch(batch, groups=None, pad_token_id=0, ignore_index=-100)``, ``ShardedSequenceLoader``.
- ``sequence_loss(logits_or_hidden, labels, groups=None, *, ignore_index, chunk_size, head)``: tiled.
"""

from __future__ import annotations

from ds_strategy.sequence.all_to_all import seq_all_to_all, seq_all_to_all_many
from ds_strategy.sequence.attention import DistributedAttention
from ds_strategy.sequence.batch import ShardedSequenceLoader, shard_batch
from ds_strategy.sequence.groups import SequenceGroups, active_groups, set_active
from ds_strategy.sequence.hf import register
from ds_strategy.sequence.loss import sequence_loss

__all__ = [
    "DistributedAttention",
    "SequenceGroups",
    "ShardedSequenceLoader",
    "active_groups",
    "register",
    "seq_all_to_all",
    "seq_all_to_all_many",
    "sequence_loss",
    "set_active",
    "shard_batch",
]
