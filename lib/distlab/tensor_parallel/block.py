"""The parallel MLP and the whole tensor-parallel transformer block (optionally sequence
parallel), built from the dense distlab.models.Block."""
import torch.nn as nn
import torch.nn.functional as F

from .. import _argcheck as check
from .attention import ParallelAttention
from .layers import (ColumnParallelLinear, RowParallelLinear, _copy_shards, match_dense,
                     replicated)


class ParallelMLP(nn.Module):
    """fc1 column-parallel → GELU on the local slice → fc2 row-parallel.

    GELU works element by element, so it runs on rank r's slice of the hidden layer with no
    communication: one all-reduce in forward (fc2's) and one in backward (fc1's input).
    """

    def __init__(self, d_model, hidden, group=None, sequence_parallel=False, dtype=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(d_model, hidden, group, sequence_parallel=sequence_parallel,
                                        dtype=dtype)
        self.fc2 = RowParallelLinear(hidden, d_model, group, sequence_parallel=sequence_parallel,
                                     dtype=dtype)

    @classmethod
    def from_dense(cls, mlp, group=None, sequence_parallel=False):
        check.like(mlp, ("fc1", "fc2"), "mlp", "a distlab.models FeedForward (block.mlp)")
        tp = cls(mlp.fc1.in_features, mlp.fc1.out_features, group, sequence_parallel,
                 dtype=mlp.fc1.weight.dtype)
        _copy_shards(tp.fc1, mlp.fc1)
        _copy_shards(tp.fc2, mlp.fc2)
        return match_dense(tp.to(mlp.fc1.weight.device), mlp, "ParallelMLP.from_dense")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

class ParallelBlock(nn.Module):
    """distlab.models.Block, tensor parallel; with the same parameter names (ln1, attn.qkv, ...).

    sequence_parallel=False: x is (b, t, d) and the same on every rank, and so is the output.
    sequence_parallel=True:  x is rank r's slice (b, t/tp, d) of the sequence, and so is the
    output; LayerNorms and residual adds work on the slice.
    """

    def __init__(self, d_model, n_heads, hidden, group=None, sequence_parallel=False, dtype=None,
                 n_kv_heads=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype)
        self.attn = ParallelAttention(d_model, n_heads, group, sequence_parallel, dtype,
                                      n_kv_heads=n_kv_heads)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype)
        self.mlp = ParallelMLP(d_model, hidden, group, sequence_parallel, dtype)

    @classmethod
    def from_dense(cls, block, group=None, sequence_parallel=False):
        check.like(block, ("ln1", "attn", "ln2", "mlp"), "ParallelBlock.from_dense's block",
                   "a distlab.models Block (one of gpt.blocks)")
        d, hidden = block.ln1.normalized_shape[0], block.mlp.fc1.out_features
        tp = cls(d, block.attn.n_heads, hidden, group, sequence_parallel,
                 dtype=block.ln1.weight.dtype, n_kv_heads=getattr(block.attn, "n_kv_heads", None))
        tp.ln1.load_state_dict(block.ln1.state_dict())
        tp.ln2.load_state_dict(block.ln2.state_dict())
        tp.attn = ParallelAttention.from_dense(block.attn, group, sequence_parallel)
        tp.mlp = ParallelMLP.from_dense(block.mlp, group, sequence_parallel)
        return match_dense(tp.to(block.ln1.weight.device), block, "ParallelBlock.from_dense")

    def _norm(self, ln, x):
        if not self.sequence_parallel:
            return ln(x)  # every rank normalises the same x: its gradients are already whole
        return F.layer_norm(x, ln.normalized_shape, replicated(ln.weight, self.group),
                            replicated(ln.bias, self.group), ln.eps)

    def forward(self, x):
        check.features(x, self.ln1.normalized_shape[0], "x", self.ln1.weight, at_least_dims=3,
                       shape_hint="(batch, tokens, d_model)")
        x = x + self.attn(self._norm(self.ln1, x))
        return x + self.mlp(self._norm(self.ln2, x))
