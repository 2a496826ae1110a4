"""Tensor parallelism equals the dense model: outputs, every gradient (weights, biases, input) and
parameters after several optimizer steps, at TP 1 to 6, with and without sequence parallel;
the communication is what the formula says; DTensor's parallelize_module gives our numbers."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distlab
from distlab import tensor_parallel as tpm
from distlab import tp_comm
from distlab.models import Attention, Block, GroupedQueryAttention

TIMEOUT = 120
F64 = torch.float64


def close(what, got, expected, atol=1e-12, rtol=1e-10):
    """Raise on the rank (the launcher names it) with the first element that differs."""
    if got is None or tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}, got "
                             f"{None if got is None else tuple(got.shape)}")
    bad = ~torch.isclose(got, expected, atol=atol, rtol=rtol)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}, element {list(i)}: expected {expected[i].item():.17g}, "
                             f"got {got[i].item():.17g}")


def rank_data(rank, *shape):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(100 + rank))


# ---- the communication Functions ---------------------------------------------------------------

def _functions_case(rank, ws):
    """Each Function against a single-process reference built from every rank's data."""
    rows = 2 * ws
    xs = [rank_data(r, rows, 3) for r in range(ws)]      # what each rank passes in
    gs = [rank_data(50 + r, rows * ws, 3) for r in range(ws)]  # gradient each rank gets
    whole = torch.cat(xs)                                  # all ranks' inputs, stacked
    cases = {
        "identity_fwd_all_reduce_bwd": (lambda x: tp_comm.identity_fwd_all_reduce_bwd(x, None),
                                        xs[rank], lambda g: sum(g)),
        "all_reduce_fwd_identity_bwd": (lambda x: tp_comm.all_reduce_fwd_identity_bwd(x, None),
                                        sum(xs), lambda g: g[rank]),
        "all_gather_fwd_split_bwd": (lambda x: tp_comm.all_gather_fwd_split_bwd(x, None, 0),
                                     whole, lambda g: g[rank].chunk(ws)[rank]),
        "split_fwd_all_gather_bwd": (lambda x: tp_comm.split_fwd_all_gather_bwd(x, None, 0),
                                     whole.chunk(ws)[rank], lambda g: torch.cat(g)),
        "all_gather_fwd_reduce_scatter_bwd": (
            lambda x: tp_comm.all_gather_fwd_reduce_scatter_bwd(x, None, 0),
            whole, lambda g: sum(g).chunk(ws)[rank]),
        "reduce_scatter_fwd_all_gather_bwd": (
            lambda x: tp_comm.reduce_scatter_fwd_all_gather_bwd(x, None, 0),
            sum(xs).chunk(ws)[rank], lambda g: torch.cat(g)),
    }
    for name, (op, expected_out, expected_grad) in cases.items():
        # Input: the whole stack for the split, this rank's own tensor for the others.
        x = (whole if name.startswith("split") else xs[rank]).clone().requires_grad_()
        out = op(x)
        close(f"{name} forward", out, expected_out)
        grads = [g[:out.shape[0]] for g in gs]  # every rank's gradient w.r.t. the output
        out.backward(grads[rank])
        close(f"{name} backward", x.grad, expected_grad(grads))
    return True


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 6])
def test_communication_functions_forward_and_backward(ws):
    assert distlab.run(_functions_case, ws, timeout=TIMEOUT) == [True] * ws


# ---- the linear layers --------------------------------------------------------------------------

def _linear_case(rank, ws):
    torch.manual_seed(0)
    in_f, out_f = 3 * ws, 2 * ws
    dense = nn.Linear(in_f, out_f, dtype=F64)
    x = torch.randn(5, in_f, dtype=F64, requires_grad=True)
    r = torch.randn(5, out_f, dtype=F64)
    y = dense(x)
    (y * r).sum().backward()
    col = tpm.ColumnParallelLinear.from_dense(dense, gather_output=True)
    row_full = tpm.RowParallelLinear.from_dense(dense, input_is_parallel=False)
    row_split = tpm.RowParallelLinear.from_dense(dense)
    for name, layer in [("column", col), ("row (full input)", row_full),
                        ("row (split input)", row_split)]:
        xi = x.detach().clone()
        if layer is row_split:
            xi = xi.chunk(ws, dim=1)[rank].clone()
        xi.requires_grad_()
        yi = layer(xi)
        close(f"{name} output", yi, y)
        (yi * r).sum().backward()
        expected_x = x.grad.chunk(ws, dim=1)[rank] if layer is row_split else x.grad
        close(f"{name} input grad", xi.grad, expected_x)
        close(f"{name} weight grad", layer.weight.grad, layer.shard_of(dense.weight.grad))
        close(f"{name} bias grad", layer.bias.grad, layer.shard_of(dense.bias.grad))
    # Column without gather: each rank holds exactly its slice of y.
    col2 = tpm.ColumnParallelLinear.from_dense(dense)
    close("column slice", col2(x.detach()), y.detach().chunk(ws, dim=1)[rank])
    return True


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 6])
def test_column_and_row_linear_equal_dense(ws):
    assert distlab.run(_linear_case, ws, timeout=TIMEOUT) == [True] * ws


# ---- the block, trained for several steps -------------------------------------------------------

def _uses(module):
    """{name: (requires_grad, the names that share its Parameter)}, every name of every use."""
    every = list(module.named_parameters(remove_duplicate=False))
    return {n: (p.requires_grad, sorted(m for m, q in every if q is p)) for n, p in every}


def _train_block_case(rank, ws, sequence_parallel, steps=3, group=None, data_seed=0,
                      frozen_and_tied=False):
    """SGD on the dense block and on its TP twin; compare loss, every grad, params each step.
    frozen_and_tied: attn.qkv and ln2.bias frozen, ln2.weight tied to ln1.weight (one Parameter
    used twice); the twin must keep both, None gradients included."""
    torch.manual_seed(0)  # the same dense block on every rank
    dense = Block(4 * ws, ws, 8 * ws).to(F64)
    if frozen_and_tied:
        dense.attn.qkv.requires_grad_(False)
        dense.ln2.bias.requires_grad_(False)
        dense.ln2.weight = dense.ln1.weight
    tp = tpm.ParallelBlock.from_dense(dense, group, sequence_parallel)
    assert _uses(tp) == _uses(dense), f"from_dense: {_uses(tp)}, dense: {_uses(dense)}"
    seq = 2 * dist.get_world_size(group)
    cut = (lambda t: tpm.sequence_slice(t, group)) if sequence_parallel else (lambda t: t)
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(data_seed)
    for step in range(steps):
        x = torch.randn(2, seq, dense.ln1.normalized_shape[0], dtype=F64, generator=g)
        target = torch.randn(x.shape, dtype=F64, generator=g)
        xd = x.clone().requires_grad_()
        y = dense(xd)
        loss = ((y - target) ** 2).sum() / y.numel()
        opt_d.zero_grad()
        loss.backward()
        xt = cut(x).clone().requires_grad_()
        yt = tp(xt)
        loss_t = ((yt - cut(target)) ** 2).sum() / y.numel()
        opt_t.zero_grad()
        loss_t.backward()
        total = loss_t.detach().clone()
        if sequence_parallel:
            dist.all_reduce(total, group=group)  # each rank's loss covers its slice only
        where = f"step {step}"
        close(f"{where} loss", total, loss.detach())
        close(f"{where} output", yt.detach(), cut(y.detach()))
        close(f"{where} input grad", xt.grad, cut(xd.grad))
        expected = tpm.dense_shards(tp, dense, grads=True)
        for name, p in tp.named_parameters():
            if (p.grad is None) != (expected[name] is None):
                raise AssertionError(f"{where} grad of {name}: dense None is "
                                     f"{expected[name] is None}, TP None is {p.grad is None}")
            if p.grad is not None:
                close(f"{where} grad of {name}", p.grad, expected[name])
        opt_d.step()
        opt_t.step()
        expected = tpm.dense_shards(tp, dense)
        for name, p in tp.named_parameters():
            close(f"{where} {name} after the step", p.detach(), expected[name])
    return True


def _both_modes_case(rank, ws):
    return [_train_block_case(rank, ws, sp, frozen_and_tied=odd) for sp in (False, True)
            for odd in (False, True)]


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 6])
def test_block_trains_like_dense_with_and_without_sequence_parallel(ws):
    """Also with frozen parameters and a LayerNorm weight tied to the other's (before, from_dense
    trained the frozen ones and untied the tie)."""
    assert distlab.run(_both_modes_case, ws, timeout=TIMEOUT) == [[True] * 4] * ws


def _mesh_case(rank, ws):
    """TP inside a 2 x 2 mesh: each TP group (its own data) matches the dense block."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    return _train_block_case(rank, ws, True, steps=2, group=mesh["tp"].get_group(),
                             data_seed=dp_rank)


def test_block_on_the_tp_groups_of_a_mesh():
    assert distlab.run(_mesh_case, 4, timeout=TIMEOUT) == [True] * 4


# ---- grouped-query attention --------------------------------------------------------------------

def _gqa_case(rank, ws, n_heads, n_kv_heads, d_head):
    """ParallelAttention(n_kv_heads=...) against the dense GroupedQueryAttention, with and
    without sequence parallel: output, input grad, every parameter's grad (its dense slice)."""
    torch.manual_seed(0)
    d = n_heads * d_head
    dense = GroupedQueryAttention(d, n_heads, n_kv_heads).to(F64)
    x = torch.randn(2, 2 * ws, d, dtype=F64)
    xd = x.clone().requires_grad_()
    y = dense(xd)
    (y * y).sum().backward()
    for sp in (False, True):
        cut = (lambda z: tpm.sequence_slice(z, None)) if sp else (lambda z: z)
        tp = tpm.ParallelAttention.from_dense(dense, None, sp)
        xt = cut(x).clone().requires_grad_()
        yt = tp(xt)
        (yt * yt).sum().backward()
        where = f"tp={ws}, {n_heads} q / {n_kv_heads} kv heads, sp={sp}"
        close(f"{where} output", yt.detach(), cut(y.detach()))
        close(f"{where} input grad", xt.grad, cut(xd.grad))
        expected = tpm.dense_shards(tp, dense, grads=True)
        assert set(expected) == {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}
        for name, p in tp.named_parameters():
            close(f"{where} grad of {name}", p.grad, expected[name])
    group = n_heads // n_kv_heads            # query heads per K/V head
    return list(tp.q_heads), list(tp.kv_heads), tp.kv_copies, group


@pytest.mark.parametrize("ws,n_heads,n_kv_heads,d_head",
                         [(1, 4, 2, 4), (2, 4, 2, 4), (4, 4, 2, 4), (3, 6, 3, 2), (6, 6, 3, 2)])
def test_grouped_query_attention_equals_dense(ws, n_heads, n_kv_heads, d_head):
    got = distlab.run(_gqa_case, ws, n_heads, n_kv_heads, d_head, timeout=TIMEOUT)
    copies = max(1, ws // n_kv_heads)
    for rank, (q_heads, kv_heads, kv_copies, group) in enumerate(got):
        per = n_heads // ws
        assert q_heads == list(range(rank * per, (rank + 1) * per))
        # a rank's K/V heads are exactly those its query heads use
        assert kv_heads == sorted({h // group for h in q_heads})
        assert kv_copies == copies
    # past tp = n_kv_heads, each K/V head is used by tp / n_kv_heads ranks
    held = [h for _, kv_heads, _, _ in got for h in kv_heads]
    assert sorted(held) == sorted(list(range(n_kv_heads)) * copies)


def _mha_unchanged_case(rank, ws):
    """n_kv_heads=None is the multi-head layer of before (parameters, shapes, numbers), and
    the dense GQA reference with n_kv_heads = n_heads is the dense multi-head Attention."""
    torch.manual_seed(0)
    mha = Attention(8, 4).to(F64)
    gqa = GroupedQueryAttention(8, 4, 4).to(F64)
    gqa.load_state_dict(mha.state_dict())
    x = torch.randn(2, 4, 8, dtype=F64)
    close("GQA reference with n_kv = n_heads", gqa(x), mha(x))
    tp = tpm.ParallelAttention.from_dense(mha)
    shapes = {n: tuple(p.shape) for n, p in tp.named_parameters()}
    assert shapes == {"qkv.weight": (24 // ws, 8), "qkv.bias": (24 // ws,),
                      "proj.weight": (8, 8 // ws), "proj.bias": (8,)}, shapes
    assert tp.n_kv_heads is None and tp.kv_copies == 1 and tp.local_kv_heads == tp.local_heads
    close("MHA output", tp(x), mha(x))
    return True


def test_multi_head_attention_is_unchanged():
    assert distlab.run(_mha_unchanged_case, 2, timeout=TIMEOUT) == [True, True]


def _messages_of(attempts):
    """{what: the ValueError's sentence} for each attempt that raises one."""
    messages = {}
    for what, attempt in attempts.items():
        try:
            attempt()
        except ValueError as e:
            messages[what] = str(e)
    return messages


def _gqa_error_case(rank, ws):
    attempts = {"heads": lambda: tpm.ParallelAttention(24, 6, n_kv_heads=3),
                "groups": lambda: tpm.ParallelAttention(16, 8, n_kv_heads=3),
                "kv split": lambda: tpm.ParallelAttention(24, 12, n_kv_heads=6),
                "kv multiple": lambda: tpm.ParallelAttention(24, 12, n_kv_heads=3),
                "d_head": lambda: tpm.ParallelAttention(4, 4, n_kv_heads=2)}
    return _messages_of(attempts)


def test_grouped_query_attention_configuration_errors_are_clear_sentences():
    messages = distlab.run(_gqa_error_case, 4, timeout=TIMEOUT)[0]
    assert messages == {
        "heads": "n_heads=6 does not split evenly across 4 tensor-parallel ranks; choose a tp "
                 "that divides it and suits n_kv_heads=3: one of [1, 3, 6].",
        "groups": "n_heads=8 must be a multiple of n_kv_heads=3 (each K/V head serves a group "
                  "of query heads).",
        "kv split": "n_kv_heads=6 does not split evenly across 4 ranks; choose a tp that divides "
                    "it (or a multiple of it): one of [1, 2, 3, 6, 12].",
        "kv multiple": "tp=4 > n_kv_heads=3 needs tp to be a multiple of n_kv_heads, so that "
                       "every K/V head is shared by the same number of ranks; choose one of "
                       "[1, 3, 6, 12].",
        "d_head": "d_head = 1 (d_model 4 / n_heads 4) must be a multiple of tp / n_kv_heads = 2: "
                  "each K/V head's projection is split across the 2 ranks that share it; "
                  "choose such a d_model, or a tp of at most n_kv_heads = 2."}


# ---- clear errors -------------------------------------------------------------------------------

def _error_case(rank, ws, uncaught=False):
    attempts = {"column": lambda: tpm.ColumnParallelLinear(4, 10),
                "row": lambda: tpm.RowParallelLinear(7, 4),
                "heads": lambda: tpm.ParallelAttention(16, 4),
                "seq": lambda: tpm.sequence_slice(torch.zeros(1, 5, 4), None),
                "tied": lambda: tpm.ParallelBlock.from_dense(_square_tied_block())}
    messages = _messages_of(attempts)
    if uncaught and rank == 1:
        tpm.ColumnParallelLinear(4, 10)  # as a learner meets it
    return messages


def _square_tied_block():
    """A block whose MLP is square (hidden = d_model) with fc2's weight tied to fc1's."""
    block = Block(6, 3, 6).to(F64)
    block.mlp.fc2.weight = block.mlp.fc1.weight
    return block


def test_dimension_that_does_not_divide_is_a_clear_error():
    with pytest.raises(distlab.RankFailed) as e:
        distlab.run(_error_case, 3, True, timeout=TIMEOUT)
    assert e.value.rank == 1 and e.value.exc_type == "ValueError"
    assert str(e.value).splitlines()[0] == (
        "rank 1 raised ValueError: out_features = 10 does not split evenly across 3 "
        "tensor-parallel ranks; choose a multiple of 3.")
    messages = distlab.run(_error_case, 3, timeout=TIMEOUT)[0]
    for key, what, size in [("column", "out_features", 10), ("row", "in_features", 7),
                            ("heads", "n_heads", 4), ("seq", "seq_len", 5)]:
        assert messages[key] == (f"{what} = {size} does not split evenly across 3 "
                                 f"tensor-parallel ranks; choose a multiple of 3.")
    # a tie of parameters split across ranks cannot be kept: refused, never silently untied
    assert messages["tied"] == (
        "ParallelMLP.from_dense cannot keep fc1.weight and fc2.weight tied: tensor parallelism "
        "splits fc1.weight across ranks; untie them (give each its own nn.Parameter) or leave "
        "them out of the tensor-parallel module.")


# ---- communication volume and activation memory -------------------------------------------------

def _count_case(rank, ws):
    return [_count_one(ws, sp) for sp in (False, True)]


def _count_one(ws, sp):
    b, t, d = 2, 2 * ws, 4 * ws
    torch.manual_seed(0)
    dense = Block(d, ws, 2 * d).to(F64)
    tp = tpm.ParallelBlock.from_dense(dense, None, sp)
    x = torch.randn(b, t // ws if sp else t, d, dtype=F64, requires_grad=True)
    with tp_comm.count_comm() as log:
        tp(x).sum().backward()
    _, saved = tpm.saved_activation_bytes(lambda m, z: m(z), tp, x)
    return [entry for entry in log if entry[2] > 8 * d], saved  # drop the small parameter grads


@pytest.mark.parametrize("ws", [2, 4])
def test_communication_volume_and_sequence_parallel_memory(ws):
    b, t, d = 2, 2 * ws, 4 * ws
    s = b * t * d * 8  # one activation, float64
    ((log, saved_tp), (log_sp, saved_sp)), *_ = distlab.run(_count_case, ws, timeout=TIMEOUT)
    assert log == [("all_reduce", "forward", s)] * 2 + [("all_reduce", "backward", s)] * 2
    # Same bytes on a ring: an all-reduce is a reduce-scatter followed by an all-gather.
    assert sorted(log_sp) == sorted([("all_gather", "forward", s), ("reduce_scatter", "forward", s)]
                                 * 2 + [("reduce_scatter", "backward", s),
                                        ("all_gather", "backward", s)] * 2)
    assert saved_sp < saved_tp


# ---- DTensor ------------------------------------------------------------------------------------

def _dtensor_case(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from distlab import tp_dtensor
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    for dense in (Block(8, 2, 16).to(F64), Block(8, 4, 16, n_kv_heads=2).to(F64)):
        _dtensor_matches(dense, mesh, ws)
    try:                          # 1 K/V head cannot be cut into ws contiguous blocks of rows
        tp_dtensor.parallelize_block(Block(8, 4, 16, n_kv_heads=1).to(F64), mesh)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return refusal


def _dtensor_matches(dense, mesh, ws):
    from distlab import tp_dtensor
    x = torch.randn(2, 2 * ws, 8, dtype=F64)
    for sp in (False, True):
        cut = (lambda z: tpm.sequence_slice(z, None)) if sp else (lambda z: z)
        ours = tpm.ParallelBlock.from_dense(dense, None, sp)
        theirs = tp_dtensor.parallelize_block(dense, mesh, sp)
        outputs, input_grads = [], []
        for model in (ours, theirs):
            xi = cut(x).clone().requires_grad_()
            y = model(xi)
            (y * y).sum().backward()
            outputs.append(y.detach())
            input_grads.append(xi.grad)
        label = "sequence parallel" if sp else "tensor parallel"
        close(f"{label} output", outputs[1], outputs[0])
        close(f"{label} input grad", input_grads[1], input_grads[0])
        mine = dict((n, p.grad) for n, p in ours.named_parameters())
        dtensors = tp_dtensor.local_grads(theirs)
        assert set(mine) == set(dtensors), set(mine) ^ set(dtensors)
        for name in mine:
            close(f"{label} grad of {name}", dtensors[name], mine[name])


def test_dtensor_parallelize_module_matches_ours_also_with_grouped_query_heads():
    for refusal in distlab.run(_dtensor_case, 2, timeout=TIMEOUT):
        assert refusal.startswith("ColwiseParallel cuts k and v into 2 contiguous blocks of rows, "
                                  "which would split the block's 1 K/V heads;"), refusal


def test_dtensor_twin_keeps_a_frozen_qkv_frozen():
    """SeparateQKVAttention makes q, k, v as fresh Linears; before, they forgot that the fused
    qkv was frozen and would train (no process group needed)."""
    from distlab.tp_dtensor import SeparateQKVAttention
    attn = Attention(8, 4).to(F64)
    attn.qkv.requires_grad_(False)
    twin = SeparateQKVAttention(attn)
    frozen = {n: p.requires_grad for n, p in twin.named_parameters()}
    assert frozen == {f"{z}.{k}": z == "proj" for z in ("q", "k", "v", "proj")
                      for k in ("weight", "bias")}, frozen


def _llama_block_case(rank, ws):
    from distlab import zero_memory
    torch.manual_seed(0)
    h, a, f, s = 16, 4, 24, 6
    dense = zero_memory.LlamaBlock(h, a, f, dtype=torch.float64)
    tp = tpm.ParallelLlamaBlock(h, a, f, dtype=torch.float64)
    with torch.no_grad():
        for name in ("norm1", "norm2"):
            getattr(tp, name).weight.copy_(getattr(dense, name).weight)
        for name in ("qkv", "out", "gate_up", "down"):
            getattr(tp, name).weight.copy_(getattr(tp, name).shard_of(getattr(dense, name).weight))
    x = torch.randn(2, s, h, dtype=torch.float64, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    cos, sin = zero_memory.rotary_tables(s, h // a, torch.float64)
    y, yt = dense(x, cos, sin), tp(xt, cos, sin)
    (y ** 2).sum().backward()
    (yt ** 2).sum().backward()
    close("output", yt, y)
    close("input grad", xt.grad, x.grad)
    for name in ("qkv", "out", "gate_up", "down"):
        layer = getattr(tp, name)
        close(name, layer.weight.grad, layer.shard_of(getattr(dense, name).weight.grad))
    return True


def test_parallel_llama_block_equals_the_dense_block():
    # the real-size lesson of chapter 07 runs this block on meta tensors: here it is proven
    assert distlab.run(_llama_block_case, 2, timeout=TIMEOUT) == [True, True]


def test_gqa_copy_traffic_prices_ours_against_megatron_by_hand():
    """Past n_kv_heads: ours all-gathers K and V (2·n_kv·d_head values per token), Megatron-LM
    the whole QKV output ((n_heads + 2·n_kv)·d_head); each forward (all-gather) and backward
    (reduce-scatter), (tp−1)/tp of the gathered bytes per rank on a ring. No copies: nothing."""
    t = tpm.gqa_copy_traffic(8192, 64, 8, 16, tokens=1)           # Llama-3 70B at tp = 16, bf16
    ring = 2 * 15 / 16 * 2                                          # fwd + bwd, (N-1)/N, 2 bytes
    assert t["ours (gather K and V)"] == pytest.approx(ring * 2 * 8 * 128)
    assert t["Megatron-LM (gather all of QKV)"] == pytest.approx(ring * (8192 + 2 * 8 * 128))
    assert t["the layer's all-reduces"] == pytest.approx(2 * 2 * 15 / 16 * 8192 * 2)
    assert t["Megatron-LM (gather all of QKV)"] == pytest.approx(5 * t["ours (gather K and V)"])
    none = tpm.gqa_copy_traffic(8192, 64, 8, 8, tokens=3)
    assert none["ours (gather K and V)"] == none["Megatron-LM (gather all of QKV)"] == 0
    with pytest.raises(ValueError, match="does not split evenly across 12"):
        tpm.gqa_copy_traffic(8192, 64, 8, 12, tokens=1)
