"""The vocabulary-parallel embedding, LM head and cross-entropy equal the dense ones in float64 at
tp = 2 and 3: the loss and the gradients of the embedding, the head (untied and tied) and the
hidden states, with and without sequence parallelism, for vocabularies that divide by tp and
vocabularies that are padded; the loss survives logits near 1000, never gathers the logits, and
equals torch's loss_parallel; padding labels are ignored as F.cross_entropy ignores them, and
targets outside the vocabulary are refused. One launch per world size."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab import tp_comm
from distlab import tensor_parallel as tpm
from distlab import vocab_parallel as vp
from test_tensor_parallel import close      # first differing element, raised on the rank

F64 = torch.float64


def _dense(vocab, d, tied, seed):
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(vocab, d, dtype=F64)
    head = nn.Linear(d, vocab, bias=not tied, dtype=F64)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vocab, d, generator=g, dtype=F64))
        head.weight.copy_(torch.randn(vocab, d, generator=g, dtype=F64) / d ** 0.5)
        if head.bias is not None:
            head.bias.copy_(torch.randn(vocab, generator=g, dtype=F64))
    if tied:
        head.weight = emb.weight                 # one Parameter: GPT-2's tied embedding
    return emb, head


def _lm(emb, head, ids, target, sp=False, parallel=False, vocab=None):
    """embedding → a nonlinearity (so the head's input gradient reaches the embedding) → head
    → mean cross-entropy; dense or vocab-parallel."""
    x = emb(ids)
    hidden = torch.tanh(x) * 1.5
    logits = head(hidden)
    if not parallel:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()), hidden
    return vp.vocab_parallel_cross_entropy(logits, target, vocab).mean(), hidden


def _case(rank, ws):
    b, s, d = 2, 2 * ws, 5
    checked = []
    # each pair of (divides by tp | padded), (untied | tied), (TP | TP + SP) is covered once
    for vocab, tied, sp in ((4 * ws, False, False), (4 * ws, True, True),
                            (4 * ws + 1, False, True), (4 * ws + 1, True, False)):
        emb, head = _dense(vocab, d, tied, seed=vocab)
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, vocab, (b, s), generator=g)
        target = torch.randint(0, vocab, (b, s), generator=g)
        loss, hidden = _lm(emb, head, ids, target)
        hidden.retain_grad()
        loss.backward()

        pe = vp.VocabParallelEmbedding.from_dense(emb, sequence_parallel=sp)
        ph = vp.ParallelLMHead.from_dense(head, sequence_parallel=sp,
                                          tie_to=pe if tied else None)
        if tied:
            assert ph.weight is pe.weight
        with tp_comm.count_comm() as log:
            ploss, phidden = _lm(pe, ph, ids, target, sp, parallel=True, vocab=vocab)
            phidden.retain_grad()
            ploss.backward()
        label = f"V={vocab} tied={tied} sp={sp}"
        close(f"{label} loss", ploss, loss)
        expect_h = tpm.sequence_slice(hidden.grad, None) if sp else hidden.grad
        close(f"{label} hidden grad", phidden.grad, expect_h)
        close(f"{label} embedding grad", pe.weight.grad, pe.shard_of(emb.weight.grad))
        if not tied:
            close(f"{label} head grad", ph.weight.grad, ph.shard_of(head.weight.grad))
            close(f"{label} head bias grad", ph.bias.grad, ph.shard_of(head.bias.grad))
        # padding rows: zero, and never trained
        real = max(0, min(pe.stop, vocab) - pe.first)
        assert not pe.weight.grad[real:].any() and not pe.weight[real:].any(), label
        # what travels: activations of (b, s, d) and per-token numbers, never logits
        biggest = max(n for *_, n in log)
        assert biggest == b * s * d * 8, (label, log)
        tokens = b * s * 8                                     # one float64 per token
        assert [e for e in log if e[2] < biggest] == [("all_reduce", "forward", tokens),
                                                      ("all_reduce", "forward", 2 * tokens)]
        checked.append(label)

    # the loss alone: logits near 1000 (exp overflows float64 above 709), targets on every rank
    vocab, tokens = 3 * ws + 2, 7
    g = torch.Generator().manual_seed(3)
    full = 1000 + 5 * torch.randn(tokens, vocab, generator=g, dtype=F64)
    target = torch.arange(tokens) * 5 % vocab
    first, stop = vp.vocab_range(vocab, None)
    shard = F.pad(full, (0, vp.padded_vocab_size(vocab, ws) - vocab))[:, first:stop]
    shard = shard.clone().requires_grad_()
    dense = full.clone().requires_grad_()
    weights = torch.randn(tokens, generator=g, dtype=F64)
    (F.cross_entropy(dense, target, reduction="none") * weights).sum().backward()
    loss = vp.vocab_parallel_cross_entropy(shard, target, vocab)
    (loss * weights).sum().backward()
    close("large logits: per-token loss", loss, F.cross_entropy(full, target, reduction="none"))
    expected = F.pad(dense.grad, (0, vp.padded_vocab_size(vocab, ws) - vocab))[:, first:stop]
    close("large logits: logit-shard grad", shard.grad, expected)
    assert torch.isfinite(loss).all()

    # torch's own: F.cross_entropy on logits that are DTensors sharded on the vocabulary, under
    # loss_parallel() (torchtitan's loss), gives ours - on a vocabulary that divides by tp, since
    # DTensor cuts an uneven one as torch.chunk does where ours pads
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh("cpu", (ws,))
    vocab = 2 * ws                                # <= the columns of `full`
    first, stop = vp.vocab_range(vocab, None)
    ours = full[:, :vocab][:, first:stop].clone().requires_grad_()
    theirs = ours.detach().clone().requires_grad_()
    target = target % vocab
    our_loss = vp.vocab_parallel_cross_entropy(ours, target, vocab).mean()
    our_loss.backward()
    with loss_parallel():
        dtensor_loss = F.cross_entropy(DTensor.from_local(theirs, mesh, [Shard(1)]), target)
        dtensor_loss.backward()
    close("loss_parallel: loss", dtensor_loss.full_tensor(), our_loss)
    close("loss_parallel: logit-shard grad", theirs.grad, ours.grad)
    checked += _ignored_and_refused(ws)
    return checked + _frozen(ws)


def _frozen(ws):
    """A frozen embedding and head bias stay frozen (before, from_dense made fresh Parameters
    that trained): no gradient for them, the head's weight gradient equal to the dense one."""
    vocab, d = 4 * ws + 1, 5
    emb, head = _dense(vocab, d, False, seed=1)
    emb.requires_grad_(False)
    head.bias.requires_grad_(False)
    g = torch.Generator().manual_seed(7)
    ids, target = torch.randint(0, vocab, (2, 3, 2 * ws), generator=g)
    loss, _ = _lm(emb, head, ids, target)
    loss.backward()
    pe = vp.VocabParallelEmbedding.from_dense(emb)
    ph = vp.ParallelLMHead.from_dense(head)
    frozen = [p.requires_grad for p in (pe.weight, ph.weight, ph.bias)]
    assert frozen == [False, True, False], f"requires_grad of emb, head, bias: {frozen}"
    ploss, _ = _lm(pe, ph, ids, target, parallel=True, vocab=vocab)
    ploss.backward()
    close("frozen: loss", ploss, loss)
    assert pe.weight.grad is None and ph.bias.grad is None, "a frozen parameter got a gradient"
    close("frozen: head grad", ph.weight.grad, ph.shard_of(head.weight.grad))
    return ["frozen embedding and head bias"]


def _ignored_and_refused(ws):
    """Padding labels (-100, or another ignore_index) are skipped as F.cross_entropy skips them:
    per token, mean over the rest, sum; an all-ignored batch as torch gives it (mean NaN, sum 0,
    gradient zero). A vocabulary tp divides and one it does not (padded). Then targets outside
    the vocabulary, and float targets, are refused in a sentence."""
    checked = []
    g = torch.Generator().manual_seed(11)
    for vocab in (3 * ws, 3 * ws + 1):
        first, stop = vp.vocab_range(vocab, None)
        pad = vp.padded_vocab_size(vocab, ws) - vocab
        full = 3 * torch.randn(9, vocab, generator=g, dtype=F64)
        target = torch.randint(0, vocab, (9,), generator=g)
        target[[1, 4, 5]] = -100
        in_vocab = torch.where(target < 0, vocab - 1, target)      # ignore_index a real id
        for ignore_index, labels in ((-100, target), (vocab - 1, in_vocab),
                                     (-100, torch.full((9,), -100))):
            for reduction in ("none", "mean", "sum"):
                label = f"V={vocab} ignore_index={ignore_index} {reduction}"
                dense = full.clone().requires_grad_()
                want = F.cross_entropy(dense, labels, ignore_index=ignore_index,
                                       reduction=reduction)
                shard = F.pad(full, (0, pad))[:, first:stop].clone().requires_grad_()
                got = vp.vocab_parallel_cross_entropy(shard, labels, vocab,
                                                      ignore_index=ignore_index,
                                                      reduction=reduction)
                weights = torch.linspace(0.5, 2, want.numel(), dtype=F64).view_as(want)
                (want * weights).sum().backward()
                (got * weights).sum().backward()
                if want.isnan().all():                    # torch: the mean over no token
                    assert got.isnan().all(), label
                else:
                    close(f"{label}: loss", got, want)
                close(f"{label}: logit-shard grad", shard.grad,
                      F.pad(dense.grad, (0, pad))[:, first:stop])
                checked.append(label)
    refusals = []
    logits = torch.zeros(3, 2, dtype=F64)
    for labels in (torch.tensor([0, 2 * ws, 1]), torch.tensor([0, -1, 1]),
                   torch.tensor([0.0, 1.0, 1.0])):
        try:
            vp.vocab_parallel_cross_entropy(logits, labels, 2 * ws)
        except (ValueError, TypeError) as e:
            refusals.append(str(e))
    assert refusals == [
        f"target {2 * ws} (row 1) is not a token id of the vocabulary [0, {2 * ws}): labels "
        f"must lie in it, or equal ignore_index (-100) for tokens the loss skips.",
        f"target -1 (row 1) is not a token id of the vocabulary [0, {2 * ws}): labels must lie "
        f"in it, or equal ignore_index (-100) for tokens the loss skips.",
        "target must hold integer token ids (torch.long), not torch.float32: pass the labels "
        "as token ids."], refusals
    return checked


@pytest.mark.parametrize("ws", [2, 3])
def test_vocab_parallel_embedding_head_and_loss_equal_dense(ws):
    results = distlab.run(_case, ws, timeout=120)
    assert all(len(r) == 4 + 18 + 1 for r in results) and results[0] == results[-1]


def test_padding_and_refusals():
    assert vp.padded_vocab_size(128256, 8) == 128256
    assert vp.padded_vocab_size(128256, 8, multiple_of=128) == 129024   # Megatron's default
    assert vp.padded_vocab_size(10, 3) == 12
    with pytest.raises(ValueError, match="must be >= 1"):
        vp.padded_vocab_size(0, 2)
    sizes = vp.logits_bytes(8192, 128256, tp=8)
    assert sizes["full logits"] == 8 * sizes["shard"] == 8192 * 128256 * 4
    assert sizes["all-reduced"] == 3 * 8192 * 4


def test_kv_head_split():
    assert tpm.kv_head_split(64, 8, 4) == {"q heads": 16, "kv heads": 2, "copies": 1}
    assert tpm.kv_head_split(64, 8, 16) == {"q heads": 4, "kv heads": 1, "copies": 2}
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        tpm.kv_head_split(48, 8, 12)
    with pytest.raises(ValueError, match="n_kv_heads=8 does not split evenly across 3"):
        tpm.kv_head_split(48, 8, 3)
    with pytest.raises(ValueError, match="n_heads=32 must be a multiple"):
        tpm.kv_head_split(32, 5, 2)


def test_rng_tracker_leaves_the_default_stream_alone():
    torch.manual_seed(0)
    plain = torch.rand(5)
    tracker = tpm.RNGTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    with tracker.fork():
        first = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)                   # the stream advances between forks
    assert torch.equal(torch.rand(5), plain)     # the default stream saw none of it
    torch.manual_seed(123)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))
    with pytest.raises(KeyError, match="no random stream named 'x'"):
        with tracker.fork("x"):
            pass
