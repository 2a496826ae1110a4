"""Tensor-parallel attention: the heads split across ranks, and how far grouped-query
attention's K/V heads can split."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

from .. import _argcheck as check
from ..tp_comm import all_gather_fwd_reduce_scatter_bwd
from .layers import (ColumnParallelLinear, RowParallelLinear, _copy_shards, match_dense,
                     per_rank)


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split across ranks: rank r runs n_heads/tp heads.

    Heads are independent, so each rank computes its heads' q, k, v (column-parallel), attends,
    and multiplies by its slice of the output projection's inputs (row-parallel).

    n_kv_heads (grouped-query attention, distlab.models.GroupedQueryAttention; None: one K/V
    head per query head): K/V head j serves query heads j·g ... (j+1)·g − 1, g = n_heads /
    n_kv_heads, so a rank needs the K/V heads of its own query heads (`q_heads`, `kv_heads`).
    While tp <= n_kv_heads they are its even share, n_kv_heads / tp. Past it, one K/V head
    serves the query heads of `kv_copies` = tp / n_kv_heads ranks (kv_head_split). The course's
    scheme keeps every weight evenly split: each of those ranks projects 1/kv_copies of the K/V
    head's width, only the K and V activations are all-gathered and each rank keeps its head —
    and the all-gather's backward, a reduce-scatter, sums the gradients of the ranks that share
    it. Megatron-LM does it another way, which moves more (`gqa_copy_traffic`): its fused QKV
    weight is interleaved by group (q1 q2 k1 v1 | q3 q4 k2 v2 ...) and split contiguously, so a
    rank may hold query rows only, and the layer all-gathers the WHOLE QKV output.
    """

    def __init__(self, d_model, n_heads, group=None, sequence_parallel=False, dtype=None,
                 n_kv_heads=None):
        super().__init__()
        d_model, n_heads = _check_heads(d_model, n_heads, group)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}.")
        self.group, self.n_heads, self.n_kv_heads = group, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        if n_kv_heads is None:                     # multi-head: q, k, v split alike
            self.local_heads = self.local_kv_heads = per_rank(n_heads, group, "n_heads")
            self.kv_copies, chunks, out = 1, 3, 3 * d_model
        else:
            split = kv_head_split(n_heads, n_kv_heads, dist.get_world_size(group))
            self.local_heads, self.local_kv_heads = split["q heads"], split["kv heads"]
            self.kv_copies = split["copies"]
            if self.head_dim % self.kv_copies:
                raise ValueError(
                    f"d_head = {self.head_dim} (d_model {d_model} / n_heads {n_heads}) must be "
                    f"a multiple of tp / n_kv_heads = {self.kv_copies}: each K/V head's "
                    f"projection is split across the {self.kv_copies} ranks that share it; "
                    f"choose such a d_model, or a tp of at most n_kv_heads = {n_kv_heads}.")
            chunks = (d_model, n_kv_heads * self.head_dim, n_kv_heads * self.head_dim)
            out = sum(chunks)
        rank = dist.get_rank(group)
        self.q_heads = range(rank * self.local_heads, (rank + 1) * self.local_heads)
        first_kv = self.q_heads.start // (n_heads // (n_kv_heads or n_heads))
        self.kv_heads = range(first_kv, first_kv + self.local_kv_heads)
        self.qkv = ColumnParallelLinear(d_model, out, group, chunks=chunks,
                                        sequence_parallel=sequence_parallel, dtype=dtype)
        self.proj = RowParallelLinear(d_model, d_model, group, sequence_parallel=sequence_parallel,
                                      dtype=dtype)

    @classmethod
    def from_dense(cls, attn, group=None, sequence_parallel=False):
        """From distlab.models.Attention, or GroupedQueryAttention (its n_kv_heads)."""
        check.like(attn, ("qkv", "proj", "n_heads"), "ParallelAttention.from_dense's attn",
                   "a distlab.models Attention or GroupedQueryAttention")
        d = attn.proj.in_features
        tp = cls(d, attn.n_heads, group, sequence_parallel, dtype=attn.proj.weight.dtype,
                 n_kv_heads=getattr(attn, "n_kv_heads", None))
        _copy_shards(tp.qkv, attn.qkv)
        _copy_shards(tp.proj, attn.proj)
        return match_dense(tp.to(attn.proj.weight.device), attn, "ParallelAttention.from_dense")

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.qkv.local_sizes, dim=-1)  # the whole sequence, our heads
        if self.kv_copies > 1:      # we hold 1/kv_copies of our K/V head: gather all, keep ours
            kv = all_gather_fwd_reduce_scatter_bwd(torch.stack((k, v)), self.group, dim=-1)
            k, v = kv.narrow(-1, self.kv_heads.start * self.head_dim, self.head_dim).unbind(0)
        b, t, _ = q.shape
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))

    def attend(self, q, k, v):
        """Causal attention of our query heads over the sequence in hand; under grouped-query
        attention k and v hold only the K/V heads those query heads read."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=self.local_kv_heads != self.local_heads)

def kv_head_split(n_heads, n_kv_heads, tp):
    """{"q heads", "kv heads", "copies"} per rank of a GQA attention over `tp` ranks: the query
    heads always split (tp must divide them); the K/V heads split while tp <= n_kv_heads, and
    past that each rank needs ONE K/V head, the one its query heads share, and that head is
    needed on `copies` = tp / n_kv_heads ranks. vLLM replicates that head's weights on those
    ranks (inference: no gradients); Megatron-LM all-gathers the whole QKV output, the course's
    ParallelAttention only the K/V activations (`gqa_copy_traffic` prices both). Either way the
    rank's K/V activations — and its KV cache — are `copies` times the even share; under vLLM
    its K/V weights are too."""
    n_heads, n_kv_heads = check.whole(n_heads, "n_heads", 1), check.whole(n_kv_heads, "n_kv_heads")
    tp = check.whole(tp, "tp", at_least=1)
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} "
                         f"(each K/V head serves a group of query heads).")
    valid = [t for t in range(1, n_heads + 1) if n_heads % t == 0
             and (n_kv_heads % t == 0 or t % n_kv_heads == 0)]
    if n_heads % tp:
        raise ValueError(f"n_heads={n_heads} does not split evenly across {tp} tensor-parallel "
                         f"ranks; choose a tp that divides it and suits n_kv_heads={n_kv_heads}: "
                         f"one of {valid}.")
    if tp <= n_kv_heads:
        if n_kv_heads % tp:
            raise ValueError(f"n_kv_heads={n_kv_heads} does not split evenly across {tp} ranks; "
                             f"choose a tp that divides it (or a multiple of it): one of {valid}.")
        return {"q heads": n_heads // tp, "kv heads": n_kv_heads // tp, "copies": 1}
    if tp % n_kv_heads:
        raise ValueError(f"tp={tp} > n_kv_heads={n_kv_heads} needs tp to be a multiple of "
                         f"n_kv_heads, so that every K/V head is shared by the same number of "
                         f"ranks; choose one of {valid}.")
    return {"q heads": n_heads // tp, "kv heads": 1, "copies": tp // n_kv_heads}


def gqa_copy_traffic(hidden, n_heads, n_kv_heads, tp, tokens, bytes_per_value=2):
    """Bytes each rank sends per attention layer, forward + backward, on a ring over the `tp`
    ranks, for `tokens` tokens: {scheme: bytes}. Past n_kv_heads the K/V heads have copies, and
    the ranks that share one must get its activations:

    - "ours (gather K and V)": ParallelAttention all-gathers K and V of every K/V head
      (2·n_kv·d_head values per token) and reduce-scatters their gradients in backward;
    - "Megatron-LM (gather all of QKV)": `SelfAttention.get_query_key_value_tensors`, branch
      `num_query_groups < world_size`, all-gathers the whole fused QKV output
      ((n_heads + 2·n_kv)·d_head values per token: the queries too) and its backward
      reduce-scatters it;
    - "the layer's all-reduces": what the attention pays anyway, one all-reduce of the hidden
      state forward and one backward.
    The α-β model's ring volumes (cost.terms); no copies (tp <= n_kv_heads): nothing extra."""
    from .. import cost
    d_head = hidden // n_heads
    copies = kv_head_split(n_heads, n_kv_heads, tp)["copies"]

    def gathered(values_per_token):      # all-gather forward + reduce-scatter backward
        nbytes = tokens * values_per_token * bytes_per_value
        return (cost.terms("ring_all_gather", nbytes, tp)[1]
                + cost.terms("ring_reduce_scatter", nbytes, tp)[1]) if copies > 1 else 0.0

    hidden_bytes = tokens * hidden * bytes_per_value
    return {"ours (gather K and V)": gathered(2 * n_kv_heads * d_head),
            "Megatron-LM (gather all of QKV)": gathered((n_heads + 2 * n_kv_heads) * d_head),
            "the layer's all-reduces": 2 * cost.terms("ring_all_reduce", hidden_bytes, tp)[1]}


def _check_heads(d_model, n_heads, group):
    check.group(group)
    return check.whole(d_model, "d_model", at_least=1), check.whole(n_heads, "n_heads", at_least=1)
