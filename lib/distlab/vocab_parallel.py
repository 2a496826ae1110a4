"""The two ends of a language model, split over the vocabulary (Megatron-LM, Shoeybi et al. 2019).

    VocabParallelEmbedding   rank r holds rows [r·V/tp, (r+1)·V/tp) of the embedding table
    ParallelLMHead           rank r computes the logits of its own vocabulary rows only
    vocab_parallel_cross_entropy   the loss over the WHOLE vocabulary from those shards, with two
                             all-reduces of a few numbers per token: no rank ever holds the
                             (tokens × vocabulary) logits

The embedding looks up only the ids that fall in its rows, writes zeros for the others, and an
all-reduce adds the ranks' outputs: exactly one rank contributed each token's vector (Megatron's
g: all-reduce forward, identity backward; under sequence parallelism a reduce-scatter along the
sequence). The head is a column-parallel layer whose output features are the vocabulary.

Vocabularies that do not divide by tp are PADDED, as Megatron-LM does (its
--make-vocab-size-divisible-by, 128 by default, times tp): every rank holds ceil(V/tp) rows
(rounded up to `multiple_of`), the rows past V are zeros that no id looks up, and the loss leaves
their logits out, so the model is the dense one, number for number.

Every layer takes its process group explicitly; `from_dense` builds it from nn.Embedding /
nn.Linear, and `shard_of` slices (and pads) a dense-shaped tensor or gradient to this rank's rows.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import _argcheck as check
from .tp_comm import (_record, all_gather_fwd_reduce_scatter_bwd, all_reduce_fwd_identity_bwd,
                      identity_fwd_all_reduce_bwd, reduce_scatter_fwd_all_gather_bwd)


def padded_vocab_size(vocab_size, tp, multiple_of=1):
    """The vocabulary rounded up to a multiple of tp × multiple_of (Megatron-LM pads to
    tp × 128 so that every shard's matmul has a GPU-friendly width)."""
    vocab_size, tp, multiple_of = (check.whole(vocab_size, "vocab_size"), check.whole(tp, "tp"),
                                   check.whole(multiple_of, "multiple_of"))
    if vocab_size < 1 or tp < 1 or multiple_of < 1:
        raise ValueError(f"vocab_size, tp and multiple_of must be >= 1; got {vocab_size}, {tp}, "
                         f"{multiple_of}.")
    step = tp * multiple_of
    return -(-vocab_size // step) * step


def vocab_range(vocab_size, group=None, multiple_of=1):
    """(first, stop) global vocabulary rows held by this rank; stop - first is the same on every
    rank (the padded shard), and rows >= vocab_size are padding."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = padded_vocab_size(vocab_size, tp, multiple_of) // tp
    return rank * rows, (rank + 1) * rows


def _pad_rows(full, rows_total):
    """A dense (V, ...) tensor with zero rows appended up to rows_total rows."""
    missing = rows_total - full.shape[0]
    if missing < 0:
        raise ValueError(f"a tensor of {full.shape[0]} rows does not fit a padded vocabulary of "
                         f"{rows_total}.")
    return torch.cat([full, full.new_zeros(missing, *full.shape[1:])]) if missing else full


class _VocabSharded(nn.Module):
    """What the embedding and the head share: the rows this rank holds, and how to cut them."""

    def _setup(self, vocab_size, group, multiple_of):
        self.group, self.vocab_size = check.group(group), vocab_size
        self.tp = dist.get_world_size(group)
        self.padded = padded_vocab_size(vocab_size, self.tp, multiple_of)
        self.first, self.stop = vocab_range(vocab_size, group, multiple_of)
        return self.stop - self.first

    def shard_of(self, full):
        """This rank's rows of a dense (V, ...) weight, bias or gradient, zero-padded."""
        return _pad_rows(full, self.padded)[self.first:self.stop]


class VocabParallelEmbedding(_VocabSharded):
    """nn.Embedding(V, d) with the table split by rows (vocabulary entries) over `group`.

    Output: (…, d), the same on every rank — or, sequence_parallel=True, this rank's slice of
    the sequence (dim 1), as the first sequence-parallel block wants it.
    """

    def __init__(self, num_embeddings, embedding_dim, group=None, sequence_parallel=False,
                 multiple_of=1, dtype=None):
        super().__init__()
        rows = self._setup(num_embeddings, group, multiple_of)
        self.embedding_dim, self.sequence_parallel = embedding_dim, sequence_parallel
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype))
        with torch.no_grad():
            self.weight.normal_()                                 # nn.Embedding's init
            real = max(0, min(rows, num_embeddings - self.first))
            self.weight[real:].zero_()                            # padding rows stay zero

    @classmethod
    def from_dense(cls, embedding, group=None, **kw):
        check.instance(embedding, nn.Embedding, "VocabParallelEmbedding.from_dense's embedding",
                       "an nn.Embedding")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    dtype=embedding.weight.dtype, **kw)
        with torch.no_grad():
            layer.weight.copy_(layer.shard_of(embedding.weight))
        layer.weight.requires_grad_(embedding.weight.requires_grad)   # a frozen table stays so
        return layer.to(embedding.weight.device)

    def forward(self, ids):
        _check_ids(ids)
        # out-of-range ids would silently embed as zeros here (no rank holds them), where the
        # dense table raises; checking costs a host sync on a GPU, which Megatron-LM skips
        if not ids.is_meta and ids.numel() and (int(ids.min()) < 0
                                                or int(ids.max()) >= self.vocab_size):
            raise IndexError(f"token ids must lie in [0, {self.vocab_size}); got "
                             f"{int(ids.min())} … {int(ids.max())}.")
        elsewhere = (ids < self.first) | (ids >= self.stop)        # another rank's rows
        # look those up at row 0 (any valid row), then zero them: each token's vector comes
        # from exactly one rank, and the sum over ranks is the dense lookup
        rows = torch.where(elsewhere, torch.zeros_like(ids), ids - self.first)
        vectors = F.embedding(rows, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_fwd_all_gather_bwd(vectors, self.group, dim=1)
        return all_reduce_fwd_identity_bwd(vectors, self.group)


class ParallelLMHead(_VocabSharded):
    """nn.Linear(d, V) column-parallel over the vocabulary: returns this rank's logits shard
    (…, padded V / tp), never the full logits; feed it to vocab_parallel_cross_entropy.

    tie_to=a VocabParallelEmbedding: the head uses the embedding's weight shard (the same
    rows, the same Parameter), as GPT-2 and Llama-3.2 1B/3B tie them; each rank's gradient of
    that shard is the sum of the embedding's and the head's, with no extra communication.
    sequence_parallel=True: the input is this rank's slice of the sequence; it is all-gathered
    (reduce-scattered in backward) so that every rank scores every token on its vocabulary rows.
    """

    def __init__(self, in_features, vocab_size, group=None, bias=False, sequence_parallel=False,
                 tie_to=None, multiple_of=1, dtype=None):
        super().__init__()
        rows = self._setup(vocab_size, group, multiple_of)
        self.in_features, self.sequence_parallel = in_features, sequence_parallel
        if tie_to is not None:
            if (tie_to.vocab_size, tie_to.padded, tie_to.embedding_dim) != (
                    vocab_size, self.padded, in_features):
                raise ValueError(f"a tied head needs the embedding's shape and padding: "
                                 f"embedding {tie_to.vocab_size} (padded {tie_to.padded}) × "
                                 f"{tie_to.embedding_dim}, head {in_features} → {vocab_size} "
                                 f"(padded {self.padded}).")
            self.weight = tie_to.weight                            # one Parameter, two uses
        else:
            bound = 1 / math.sqrt(in_features)                    # nn.Linear's init
            self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype)
                                       .uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype)) if bias else None
        with torch.no_grad():
            real = max(0, min(rows, vocab_size - self.first))
            if tie_to is None:
                self.weight[real:].zero_()

    @classmethod
    def from_dense(cls, linear, group=None, **kw):
        check.instance(linear, nn.Linear, "ParallelLMHead.from_dense's linear", "an nn.Linear")
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    dtype=linear.weight.dtype, **kw)
        with torch.no_grad():
            if kw.get("tie_to") is None:
                layer.weight.copy_(layer.shard_of(linear.weight))
            if layer.bias is not None:
                layer.bias.copy_(layer.shard_of(linear.bias))
        if kw.get("tie_to") is None:          # a tied weight is the embedding's, frozen or not
            layer.weight.requires_grad_(linear.weight.requires_grad)
        if layer.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer.to(linear.weight.device)

    def forward(self, x):
        _check_head_input(self, x)
        if self.sequence_parallel:
            x = all_gather_fwd_reduce_scatter_bwd(x, self.group, dim=1)
        else:
            x = identity_fwd_all_reduce_bwd(x, self.group)        # f: x's gradient is a sum
        return F.linear(x, self.weight, self.bias)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """-log softmax(z)[target] over the whole vocabulary, z split over the ranks by columns.

    Forward: two all-reduces of per-token numbers — the max (so that exp cannot overflow) and
    then, in one message, the sum of exp(z − max) and the target's shifted logit (which one rank
    holds, the others add 0). Backward needs no communication: d loss / d z_v = softmax_v − [v =
    target], and each rank has the softmax of its own columns from forward. Ignored tokens
    (padding labels) cost 0 and get no gradient, as F.cross_entropy's do.
    """

    @staticmethod
    def forward(ctx, logits_shard, target, vocab_size, group, ignored):
        width = logits_shard.shape[-1]
        first = dist.get_rank(group) * width
        # float32 at least: a bf16 sum of 128k exps loses the small ones
        z = logits_shard.to(torch.promote_types(logits_shard.dtype, torch.float32))
        padding = torch.arange(first, first + width, device=z.device) >= vocab_size
        z = z.masked_fill(padding, float("-inf"))                 # padded rows are no word
        peak = z.detach().amax(dim=-1)
        _record("all_reduce", "forward", peak)                   # tp_comm.count_comm sees it
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        z = z - peak.unsqueeze(-1)
        mine = (target >= first) & (target < first + width) & ~ignored
        column = torch.where(mine, target - first, torch.zeros_like(target))
        target_z = z.gather(-1, column.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp_z = z.exp()
        both = torch.stack([exp_z.sum(dim=-1), target_z])        # one message, not two
        _record("all_reduce", "forward", both)
        dist.all_reduce(both, group=group)
        softmax = exp_z.div_(both[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, column, mine, ignored)
        ctx.logits_dtype = logits_shard.dtype
        return (both[0].log() - both[1]).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, column, mine, ignored = ctx.saved_tensors
        # subtract 1 at the target, on the rank that holds it: a scatter, not a (tokens × V/tp)
        # one-hot matrix, which at a 128k vocabulary would cost as much as the logits
        grad = softmax.scatter_add(-1, column.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        grad = grad * grad_loss.unsqueeze(-1)
        # where, not a product: the mean over no token sends an infinite grad_loss to rows that
        # must still get exactly 0, as torch's all-ignored batch does
        grad = torch.where(ignored.unsqueeze(-1), grad.new_zeros(()), grad)
        return grad.to(ctx.logits_dtype), None, None, None, None


def _check_ids(ids):
    # F.embedding would name its "indices" argument; float ids also defeat the range check
    check.tensor(ids, "ids")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must hold integer token ids (torch.long), not {ids.dtype}: pass "
                        f"the tokens as ids, e.g. torch.tensor([[3, 1, 4]]).")


def _check_head_input(head, x):
    sp = head.sequence_parallel      # the gather runs along dim 1: x needs a sequence there
    check.features(x, head.in_features, "x", head.weight, at_least_dims=3 if sp else 1,
                   shape_hint="(batch, tokens, features)" if sp else "(..., features)")


def _check_targets(target, vocab_size, ignore_index):
    """Tokens the loss skips (target == ignore_index); any other target outside the vocabulary
    is refused. Every rank holds the same targets, so each checks locally and no rank is left
    waiting in a collective: one host sync, as the embedding's id check costs."""
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer token ids (torch.long), not {target.dtype}: "
                        f"pass the labels as token ids.")
    ignored = target == ignore_index
    if not target.is_meta:
        outside = ~ignored & ((target < 0) | (target >= vocab_size))
        if outside.any():
            row = int(outside.reshape(-1).nonzero()[0])
            raise ValueError(f"target {int(target.reshape(-1)[row])} (row {row}) is not a token "
                             f"id of the vocabulary [0, {vocab_size}): labels must lie in it, or "
                             f"equal ignore_index ({ignore_index}) for tokens the loss skips.")
    return ignored


def vocab_parallel_cross_entropy(logits_shard, target, vocab_size, group=None,
                                 ignore_index=-100, reduction="none"):
    """The cross-entropy of logits split over the vocabulary as ParallelLMHead makes them (rank
    r: columns [r·w, (r+1)·w), w = the shard's width; columns >= vocab_size are padding and left
    out), equal on every rank. Tokens whose target is `ignore_index` (-100, the padding label,
    as in F.cross_entropy) cost 0 and get no gradient.

    reduction="none": the per-token loss, shaped like `target`; "mean": F.cross_entropy's
    default, the mean over the tokens NOT ignored (NaN when every token is, as torch gives;
    `.mean()` of the per-token losses would count the ignored ones); "sum"."""
    check.floating(logits_shard, "logits_shard"), check.tensor(target, "target")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits_shard {tuple(logits_shard.shape)} needs one target per row; "
                         f"target is {tuple(target.shape)}.")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum'; got {reduction!r}.")
    width, tp = logits_shard.shape[-1], dist.get_world_size(group)
    if width * tp < vocab_size:
        raise ValueError(f"{tp} shards of {width} logits cover {width * tp} entries, fewer than "
                         f"the vocabulary's {vocab_size}.")
    ignored = _check_targets(target, vocab_size, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, vocab_size, group, ignored)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (~ignored).sum().to(loss.dtype)


def logits_bytes(tokens, vocab_size, tp=1, bytes_per_value=4):
    """{"full logits", "shard", "all-reduced"}: bytes of the (tokens × V)
    logits (float32, as the loss computes them), of one rank's padded shard, and of the per-token
    numbers the vocab-parallel loss all-reduces instead (max; sum of exps and target logit)."""
    rows = padded_vocab_size(vocab_size, tp) // tp
    return {"full logits": tokens * vocab_size * bytes_per_value,
            "shard": tokens * rows * bytes_per_value,
            "all-reduced": 3 * tokens * bytes_per_value}
