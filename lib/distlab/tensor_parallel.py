"""Tensor parallelism: split each weight matrix across the ranks of a TP group.

    ColumnParallelLinear   W split by OUTPUT features: rank r computes its slice of y
    RowParallelLinear      W split by INPUT features: rank r computes a partial sum of y
    ParallelMLP            column → GELU → row: one all-reduce forward, one backward (Megatron)
    ParallelAttention      q, k, v column-parallel by heads; the output projection row-parallel;
                           grouped-query attention with n_kv_heads (K/V heads shared, Megatron)
    ParallelBlock          distlab.models.Block, tensor parallel, optionally sequence parallel
    kv_head_split          how far grouped-query attention's K/V heads split, and their copies
    model_parallel_seed    dropout's two random streams under TP (Megatron's RNG tracker)
(The vocabulary-parallel embedding, LM head and loss live in distlab.vocab_parallel.)

The communication lives in `distlab.tp_comm` as autograd Functions; the layers only choose which
one to use where. Every layer takes its process group explicitly, and `from_dense` builds it from
the dense layer of the same shape, so it can be compared with that layer number for number.

Sequence parallel (sequence_parallel=True): between the TP regions (LayerNorm, residual adds),
activations are split along the sequence (dim 1) instead of replicated. Each all-reduce becomes
a reduce-scatter (leaving a region) and an all-gather (entering the next one): the same bytes,
but LayerNorm and the residual stream hold 1/tp of the sequence on each rank.
"""
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

from .tp_comm import (all_gather_fwd_reduce_scatter_bwd, all_gather_fwd_split_bwd,
                      all_reduce_fwd_identity_bwd, identity_fwd_all_reduce_bwd,
                      reduce_scatter_fwd_all_gather_bwd, split_fwd_all_gather_bwd)


def per_rank(n, group, what):
    """n // tp, or a clear error when the ranks of `group` cannot share n evenly."""
    tp = dist.get_world_size(group)
    if n % tp:
        raise ValueError(f"{what} = {n} does not split evenly across {tp} tensor-parallel ranks; "
                         f"choose a multiple of {tp}.")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b, W (out × in) split by rows = output features; rank r holds out/tp of them.

    Every rank needs the whole x, so x enters through identity-forward / all-reduce-backward
    (or, sequence parallel, through all-gather / reduce-scatter along the sequence).
    `chunks`: the output is `chunks` stacked matrices (q, k, v) split one by one, so each rank
    gets its slice of every one of them, not a contiguous third of the stack; or a tuple of
    their sizes when they differ (grouped-query attention's q, k, v: (d, kv, kv)).
    `local_sizes`: the sizes of this rank's slices, in the same order.
    """

    def __init__(self, in_features, out_features, group=None, bias=True, gather_output=False,
                 sequence_parallel=False, chunks=1, dtype=None):
        super().__init__()
        equal = isinstance(chunks, int)
        sizes = (out_features // chunks,) * chunks if equal else tuple(chunks)
        if (equal and out_features % chunks) or sum(sizes) != out_features:
            raise ValueError(f"out_features={out_features} is not {chunks} stacked matrices.")
        if gather_output and len(sizes) > 1:
            raise ValueError("gather_output would interleave the stacked matrices; gather each "
                             "one separately instead.")
        self.group, self.chunks, self.sizes = group, len(sizes), sizes
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        what = ("out_features" if len(sizes) == 1 else f"out_features / {chunks}" if equal
                else "out_features of a stacked matrix")
        self.local_sizes = tuple(per_rank(n, group, what) for n in sizes)
        local = sum(self.local_sizes)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, dtype=dtype)) if bias else None
        _reset(self, in_features)

    def shard_of(self, full):
        """This rank's shard of a full (out × in) weight or (out,) bias — or of its gradient."""
        parts = full.split(self.sizes, dim=0)
        return torch.cat([p.chunk(self.tp, dim=0)[self.rank] for p in parts], dim=0)

    @classmethod
    def from_dense(cls, linear, group=None, **kw):
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    dtype=linear.weight.dtype, **kw)
        _copy_shards(layer, linear)
        return layer.to(linear.weight.device)     # shards live where the dense layer lived

    def forward(self, x):
        if self.sequence_parallel:
            x = all_gather_fwd_reduce_scatter_bwd(x, self.group, dim=1)
        else:
            x = identity_fwd_all_reduce_bwd(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return all_gather_fwd_split_bwd(y, self.group, dim=-1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b, W split by columns = input features; rank r holds in/tp of them.

    Rank r multiplies its slice of x's features by its slice of W: a partial sum of the full y.
    The partials are all-reduced (or, sequence parallel, reduce-scattered along the sequence).
    The bias is replicated and added once, after the sum.
    """

    def __init__(self, in_features, out_features, group=None, bias=True, input_is_parallel=True,
                 sequence_parallel=False, dtype=None):
        super().__init__()
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        local = per_rank(in_features, group, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        _reset(self, in_features)

    def shard_of(self, full):
        return full.chunk(self.tp, dim=1)[self.rank] if full.dim() == 2 else full

    @classmethod
    def from_dense(cls, linear, group=None, **kw):
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    dtype=linear.weight.dtype, **kw)
        _copy_shards(layer, linear)
        return layer.to(linear.weight.device)     # shards live where the dense layer lived

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_fwd_all_gather_bwd(x, self.group, dim=-1)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_fwd_all_gather_bwd(partial, self.group, dim=1)
        else:
            y = all_reduce_fwd_identity_bwd(partial, self.group)
        if self.bias is None:
            return y
        # Sequence parallel: each rank's bias gradient covers only its part of the sequence.
        return y + (replicated(self.bias, self.group) if self.sequence_parallel else self.bias)


def replicated(param, group):
    """A parameter every rank holds whole but uses on different data: sum its gradient."""
    return identity_fwd_all_reduce_bwd(param, group)


def _reset(layer, fan_in):
    # nn.Linear's init, with the FULL fan-in: a shard has the statistics of the dense layer.
    bound = 1 / math.sqrt(fan_in)
    with torch.no_grad():
        for p in (layer.weight, layer.bias):
            if p is not None:
                p.uniform_(-bound, bound)


def _copy_shards(layer, dense):
    with torch.no_grad():
        layer.weight.copy_(layer.shard_of(dense.weight))
        if layer.bias is not None:
            layer.bias.copy_(layer.shard_of(dense.bias))


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
        tp = cls(mlp.fc1.in_features, mlp.fc1.out_features, group, sequence_parallel,
                 dtype=mlp.fc1.weight.dtype)
        _copy_shards(tp.fc1, mlp.fc1)
        _copy_shards(tp.fc2, mlp.fc2)
        return tp.to(mlp.fc1.weight.device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split across ranks: rank r runs n_heads/tp heads.

    Heads are independent, so each rank computes its heads' q, k, v (column-parallel), attends,
    and multiplies by its slice of the output projection's inputs (row-parallel).

    n_kv_heads (grouped-query attention, distlab.models.GroupedQueryAttention; None: one K/V
    head per query head): K/V head j serves query heads j·g ... (j+1)·g − 1, g = n_heads /
    n_kv_heads, so a rank needs the K/V heads of its own query heads (`q_heads`, `kv_heads`).
    While tp <= n_kv_heads they are its even share, n_kv_heads / tp. Past it, one K/V head
    serves the query heads of `kv_copies` = tp / n_kv_heads ranks (kv_head_split). As in
    Megatron-LM, the weights stay evenly split: each of those ranks projects 1/kv_copies of
    the head's width, the K/V activations are all-gathered and each rank keeps its head — and
    the all-gather's backward, a reduce-scatter, sums the gradients of the ranks that share it.
    """

    def __init__(self, d_model, n_heads, group=None, sequence_parallel=False, dtype=None,
                 n_kv_heads=None):
        super().__init__()
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
        d = attn.proj.in_features
        tp = cls(d, attn.n_heads, group, sequence_parallel, dtype=attn.proj.weight.dtype,
                 n_kv_heads=getattr(attn, "n_kv_heads", None))
        _copy_shards(tp.qkv, attn.qkv)
        _copy_shards(tp.proj, attn.proj)
        return tp.to(attn.proj.weight.device)

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
        d, hidden = block.ln1.normalized_shape[0], block.mlp.fc1.out_features
        tp = cls(d, block.attn.n_heads, hidden, group, sequence_parallel,
                 dtype=block.ln1.weight.dtype, n_kv_heads=getattr(block.attn, "n_kv_heads", None))
        tp.ln1.load_state_dict(block.ln1.state_dict())
        tp.ln2.load_state_dict(block.ln2.state_dict())
        tp.attn = ParallelAttention.from_dense(block.attn, group, sequence_parallel)
        tp.mlp = ParallelMLP.from_dense(block.mlp, group, sequence_parallel)
        return tp.to(block.ln1.weight.device)

    def _norm(self, ln, x):
        if not self.sequence_parallel:
            return ln(x)  # every rank normalises the same x: its gradients are already whole
        return F.layer_norm(x, ln.normalized_shape, replicated(ln.weight, self.group),
                            replicated(ln.bias, self.group), ln.eps)

    def forward(self, x):
        x = x + self.attn(self._norm(self.ln1, x))
        return x + self.mlp(self._norm(self.ln2, x))


# ---- comparing with the dense model, and measuring ---------------------------------------------

def dense_shards(tp_module, dense_module, grads=False):
    """{name: this rank's shard of the dense module's parameter (or its .grad)} for every
    parameter of `tp_module`; the names are the same in both modules."""
    out = {}
    for name, _ in tp_module.named_parameters():
        owner, _, attr = name.rpartition(".")
        full = getattr(dense_module.get_submodule(owner), attr)
        full = full.grad if grads else full.detach()
        sub = tp_module.get_submodule(owner)
        out[name] = sub.shard_of(full) if hasattr(sub, "shard_of") else full
    return out


def sequence_slice(x, group, dim=1):
    """Rank r's slice of a full tensor along the sequence (a plain slice: no communication)."""
    n = per_rank(x.shape[dim], group, "seq_len")
    return x.narrow(dim, dist.get_rank(group) * n, n)


def saved_activation_bytes(fn, *args):
    """(result, bytes) of `fn(*args)`, bytes = the tensors autograd saved for backward, each
    storage counted once and parameters left out (they are weights, not activations)."""
    params, seen = set(), set()
    for a in args:
        if isinstance(a, nn.Module):
            params |= {p.untyped_storage().data_ptr() for p in a.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args)
    return result, total


# ---- a Llama block at real size, and its time in closed form -------------------------------------

class ParallelLlamaBlock(nn.Module):
    """A Llama block (distlab.zero_memory.LlamaBlock: RMSNorm, rotary, causal flash attention,
    SwiGLU, no biases) tensor parallel over `group`, Megatron's layout: q/k/v and gate/up
    column-parallel (each stacked matrix split on its own), the output and down projections
    row-parallel: one all-reduce after attention and one after the MLP in forward, one into
    each region's input in backward. Builds on the meta device for real sizes."""

    def __init__(self, hidden, heads, ffn, group=None, eps=1e-5, dtype=None):
        super().__init__()
        self.local_heads, self.head_dim = per_rank(heads, group, "heads"), hidden // heads
        self.norm1 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group, bias=False, chunks=3,
                                        dtype=dtype)
        self.out = RowParallelLinear(hidden, hidden, group, bias=False, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.gate_up = ColumnParallelLinear(hidden, 2 * ffn, group, bias=False, chunks=2,
                                            dtype=dtype)
        self.down = RowParallelLinear(ffn, hidden, group, bias=False, dtype=dtype)

    def forward(self, x, cos, sin):
        from .zero_memory import rotary
        b, s, _ = x.shape
        q, k, v = (z.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def tp_block_seconds(cluster, tp, tokens, hidden=4096, heads=32, ffn=11008,
                     dtype=torch.bfloat16):
    """{"compute", "comm"}: modeled seconds of one ParallelLlamaBlock's forward + backward on the
    first `tp` ranks of `cluster` with `tokens` tokens: each rank's matmul slices at the
    device's shape-dependent rate (Device.gemm_seconds) and its heads' causal flash attention,
    backward twice the forward; four all-reduces of the (tokens × hidden) activation on the
    link the group sees (Cluster.link_between: NVLink SHARP inside an H100 node, one ring per
    NIC across nodes). The formulas the emulator charges; elementwise work is left out."""
    dev = cluster.device
    mm = sum(dev.gemm_seconds(tokens, n, k, dtype) for n, k in
             ((3 * hidden // tp, hidden), (hidden, hidden // tp), (2 * ffn // tp, hidden),
              (hidden, ffn // tp)))
    d, a = hidden // heads, heads // tp
    attn = 2.0 * tokens * tokens * d * a / (dev.peak(dtype)
                                            * dev.gemm_efficiency(tokens, tokens, d, dtype, a))
    nbytes = tokens * hidden * torch.empty((), dtype=dtype).element_size()
    link = cluster.link_between(range(tp))
    comm = 4 * link.seconds("all_reduce", nbytes, tp) if tp > 1 else 0.0
    return {"compute": 3 * (mm + attn), "comm": comm}


# ---- grouped-query attention: how far the K/V heads split ----------------------------------------

def kv_head_split(n_heads, n_kv_heads, tp):
    """{"q heads", "kv heads", "copies"} per rank of a GQA attention over `tp` ranks: the query
    heads always split (tp must divide them); the K/V heads split while tp <= n_kv_heads, and
    past that each rank needs ONE K/V head, the one its query heads share, and that head is
    needed on `copies` = tp / n_kv_heads ranks. vLLM replicates that head's weights on those
    ranks (inference: no gradients); Megatron-LM keeps the weights evenly split and all-gathers
    the K/V activations (ParallelAttention). Either way the rank's K/V activations — and its
    KV cache — are `copies` times the even share; under vLLM its K/V weights are too."""
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


# ---- dropout under TP: which ranks must draw the same random numbers ----------------------------

def _rng_state():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class RNGTracker:
    """Named random-number streams a block of code can switch to (Megatron-LM's
    CudaRNGStatesTracker, on the CPU generator here and the current CUDA one where it is up).

    `with tracker.fork(name):` saves the default generator's state, runs the block on the
    named stream, stores that stream's advanced state and restores the default: the code
    outside draws exactly what it would have drawn without the block."""

    def __init__(self):
        self.states = {}

    def add(self, name, seed):
        saved = _rng_state()
        torch.manual_seed(seed)
        self.states[name] = _rng_state()
        _set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states:
            raise KeyError(f"no random stream named {name!r}; add it first "
                           f"(known: {sorted(self.states)}).")
        saved = _rng_state()
        _set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _rng_state()
            _set_rng_state(saved)


def model_parallel_seed(seed, group=None):
    """Megatron-LM's model_parallel_cuda_manual_seed: the default generator gets `seed` on every
    rank of the TP group (dropout on REPLICATED activations — the residual stream after g's
    all-reduce — must be identical on every rank, or the replicas drift apart), and the returned
    tracker's "model-parallel-rng" stream gets seed + 2718 + the TP rank (dropout on SHARDED
    activations — a rank's heads, its slice of the MLP hidden, or, sequence parallel, its slice
    of the sequence — must differ, or every shard gets the same mask). 2718 is Megatron's offset."""
    torch.manual_seed(seed)
    tracker = RNGTracker()
    tracker.add("model-parallel-rng", seed + 2718 + dist.get_rank(group))
    return tracker
