"""Tensor parallelism: split each weight matrix across the ranks of a TP group.

    ColumnParallelLinear   W split by OUTPUT features: rank r computes its slice of y
    RowParallelLinear      W split by INPUT features: rank r computes a partial sum of y
    ParallelMLP            column → GELU → row: one all-reduce forward, one backward (Megatron)
    ParallelAttention      q, k, v column-parallel by heads; the output projection row-parallel;
                           grouped-query attention with n_kv_heads (K/V heads shared)
    ParallelBlock          distlab.models.Block, tensor parallel, optionally sequence parallel
    kv_head_split          how far grouped-query attention's K/V heads split, and their copies
    gqa_copy_traffic       what the copies cost in bytes: ours against Megatron-LM's
    model_parallel_seed    dropout's two random streams under TP (Megatron's RNG tracker)
(The vocabulary-parallel embedding, LM head and loss live in distlab.vocab_parallel.)

The communication lives in `distlab.tp_comm` as autograd Functions; the layers only choose which
one to use where. Every layer takes its process group explicitly, and `from_dense` builds it from
the dense layer of the same shape, so it can be compared with that layer number for number.

Sequence parallel (sequence_parallel=True): between the TP regions (LayerNorm, residual adds),
activations are split along the sequence (dim 1) instead of replicated. Each all-reduce becomes
a reduce-scatter (leaving a region) and an all-gather (entering the next one): the same bytes,
but LayerNorm and the residual stream hold 1/tp of the sequence on each rank.

The package, one module per idea: `layers` (the column/row layers, replicated), `attention`
(ParallelAttention, kv_head_split, gqa_copy_traffic), `block` (ParallelMLP, ParallelBlock), `measure`
(dense_shards, sequence_slice, saved_activation_bytes), `real_size` (ParallelLlamaBlock,
tp_block_seconds, comm_bound_width: when TP becomes communication-bound), `rng` (RNGTracker,
model_parallel_seed).
"""
from .attention import ParallelAttention, gqa_copy_traffic, kv_head_split
from .block import ParallelBlock, ParallelMLP
from .layers import (ColumnParallelLinear, RowParallelLinear, _copy_shards, _reset, per_rank,
                     replicated)
from .measure import dense_shards, saved_activation_bytes, sequence_slice
from .real_size import ParallelLlamaBlock, comm_bound_width, tp_block_seconds, tp_width_step
from .rng import RNGTracker, _rng_state, _set_rng_state, model_parallel_seed
