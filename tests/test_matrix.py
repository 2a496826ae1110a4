"""The equivalence matrix (issue 42): every strategy × model feature × world size, in a pairwise
covering design (tests/matrix_models.py), against a single-process float64 reference computed
in the rank itself: the forward output, EVERY gradient (None-ness included) and the parameters
(and buffers) after 3 optimizer steps. A cell the library cannot support must be refused in a
sentence: the cell asserts the sentence. One launch per world size runs all of its cells; a
cell that raised on a rank returns the exception, so one bad cell does not stop the others.
Known defects are cells marked xfail(strict=True): they turn red when fixed."""
import builtins
import time
import traceback

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab
import matrix_models as mm

cloudpickle.register_pickle_by_value(mm)   # the ranks get the models by value, as this file

F64, BF16 = torch.float64, torch.bfloat16
STEPS, LR = 3, 0.1
CELL_TIMEOUT = 5    # seconds a rank waits in a collective before the cell counts as hung
TOL = {F64: (1e-10, 1e-9), BF16: (3e-2, 5e-2)}     # (atol, rtol) against the float64 reference


# ---- comparing with the reference -----------------------------------------------------------

def _close(problems, what, got, expected, dtype=F64):
    """Add a sentence to `problems` when got differs from expected (None-ness, shape, values)."""
    if (got is None) != (expected is None):
        problems.append(f"{what}: one process has {'no' if expected is None else 'a'} "
                        f"gradient, the strategy {'none' if got is None else 'one'}")
        return
    if got is None:
        return
    got, expected = got.detach().to(F64), expected.detach().to(F64)
    if got.shape != expected.shape:
        problems.append(f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        return
    if not got.numel():
        return
    atol, rtol = TOL[dtype]
    err = (got - expected).abs().max().item()
    if not err <= atol + rtol * expected.abs().max().item():
        problems.append(f"{what}: differs by {err:.3g} (largest |expected| "
                        f"{expected.abs().max().item():.3g})")


def _sgd(params, lr=LR):
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


# ---- data parallel: ours, torch's DDP, ZeRO-1/2/3, FSDP2 -------------------------------------

def _dp_case(strategy, feature, rank, ws, problems):
    from distlab.data_parallel import BucketedDDP, shard_batch
    from distlab.models import regression_data
    from distlab.sharding import ZeRO, gather_flat
    dtype = BF16 if feature == "bf16" else F64
    x, y = regression_data(2 * ws * STEPS, 8, 4, seed=1)
    x, y = x.double(), y.double()
    ref = mm.make_feature_net(feature)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    model = mm.make_feature_net(feature)
    names = [n for n, _ in ref.named_parameters()]
    zero = None
    if strategy == "ddp":
        if dtype == BF16:
            model.to(BF16)
        run = BucketedDDP(model, bucket_cap_mb=2e-4)    # a few hundred bytes: several buckets
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    elif strategy == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel
        if dtype == BF16:
            model.to(BF16)
        run = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    elif strategy.startswith("zero"):
        zero = ZeRO(model, int(strategy[-1]), optimizer="sgd", lr=LR, momentum=0.9,
                    prefetch=strategy == "zero3",
                    compute_dtype=BF16 if dtype == BF16 else None)
        run, opt = model, zero
    else:  # fsdp2
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (ws,))
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) \
            if dtype == BF16 else MixedPrecisionPolicy()
        # tied: torch refuses the two layers in separate groups, in a sentence that says to
        # put them in one fully_shard call; that is what a learner does
        fully_shard([model.mid, model.mid2] if feature == "tied" else model.mid, mesh=mesh,
                    mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        run = model
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    for step in range(STEPS):
        xb, yb = x[step * 2 * ws:(step + 1) * 2 * ws], y[step * 2 * ws:(step + 1) * 2 * ws]
        xs, ys = shard_batch(xb, rank, ws), shard_batch(yb, rank, ws)
        ref_opt.zero_grad()
        ref_out = ref(xb)
        F.mse_loss(ref_out, yb).backward()
        out = run(xs.to(dtype) if zero is None else xs)
        F.mse_loss(out.to(F64), ys).backward()
        if zero is not None:
            zero.step()
            got = {}
            for n, p in model.named_parameters():
                if not p.requires_grad:
                    got[n] = p.grad
                    continue
                s = next(s for q, s in zip(zero.params, zero.shards) if q is p)
                got[n] = None if s.grad is None else gather_flat(s.grad.to(F64), p.numel()) \
                    .view(p.shape)
        else:
            got = {n: None if p.grad is None else full(p.grad) for n, p in
                   model.named_parameters()}
            opt.step()
        if step == 0:
            _close(problems, "forward output", out, ref_out[rank * 2:(rank + 1) * 2], dtype)
            if sorted(got) != sorted(names):
                problems.append(f"parameters {sorted(got)}, one process {sorted(names)}")
            for n in names:
                _close(problems, f"gradient of {n}", got.get(n),
                       ref.get_parameter(n).grad, dtype)
        opt.zero_grad()
        ref_opt.step()
    if zero is not None:
        trained = dict(zip([id(p) for p in zero.params], zero.full_parameters()))
        after = {n: trained.get(id(p), p) for n, p in model.named_parameters()}
    else:
        after = {n: full(p) for n, p in model.named_parameters()}
    for n in names:
        _close(problems, f"{n} after {STEPS} steps", after[n], ref.get_parameter(n), dtype)
    for n, b in ref.named_buffers():
        _close(problems, f"buffer {n} after {STEPS} steps", full(model.get_buffer(n)), b, dtype)


# ---- tensor parallel (+ sequence parallel) --------------------------------------------------

def _shard_like(module, name, full):
    owner = module.get_submodule(name.rpartition(".")[0])
    if full is None or not hasattr(owner, "shard_of"):
        return full
    return owner.shard_of(full)


def _tp_case(strategy, feature, rank, ws, problems):
    from distlab.tensor_parallel import ParallelBlock
    sp = strategy == "tp_sp"
    dtype = BF16 if feature == "bf16" else F64
    heads, d, _ = mm.block_shape(feature, ws)
    ref = mm.make_block_net(feature, ws)
    model = mm.make_block_net(feature, ws)
    dense_block = model.block if dtype == F64 else model.block.to(BF16)
    model.block = ParallelBlock.from_dense(dense_block, None, sequence_parallel=sp)
    model.group, model.sp = None, sp
    t = 2 * ws
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, t, d, generator=g, dtype=F64) for _ in range(STEPS)]
    probe = torch.randn(2, t, d, generator=g, dtype=F64)
    mine = slice(rank * 2, rank * 2 + 2) if sp else slice(None)
    names = [n for n, _ in ref.named_parameters()]
    for step in range(STEPS):
        for p in list(model.parameters()) + list(ref.parameters()):
            p.grad = None
        ref_out = ref(xs[step])
        (ref_out * probe).sum().backward()
        out = model(xs[step][:, mine].to(dtype))
        (out.to(F64) * probe[:, mine]).sum().backward()
        if step == 0:
            _close(problems, "forward output", out, ref_out[:, mine], dtype)
            got = dict(model.named_parameters())
            if sorted(got) != sorted(names):
                problems.append(f"parameters {sorted(got)}, one process {sorted(names)}")
            for n in names:
                if n in got:
                    _close(problems, f"gradient of {n}", got[n].grad,
                           _shard_like(model, n, ref.get_parameter(n).grad), dtype)
        _sgd(model.parameters())
        _sgd(ref.parameters())
    for n, p in model.named_parameters():
        _close(problems, f"{n} after {STEPS} steps", p,
               _shard_like(model, n, ref.get_parameter(n)), dtype)


# ---- vocabulary parallel: embedding, head, cross-entropy --------------------------------------

class _VocabNet(torch.nn.Module):
    def __init__(self, v, d, tied, frozen):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(v, d), torch.nn.Linear(d, v, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if frozen:
            self.emb.requires_grad_(False)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _vocab_case(strategy, feature, rank, ws, problems):
    from distlab.vocab_parallel import (ParallelLMHead, VocabParallelEmbedding,
                                        vocab_parallel_cross_entropy)
    # uneven: padded rows on the last rank; empty: ws - 1 words, the last rank holds padding only
    v = {"uneven": 2 * ws + 1, "empty": ws - 1 if ws > 1 else 3}.get(feature, 2 * ws)
    d, tied = 8, feature == "tied"
    ref = mm.seeded(0, lambda: _VocabNet(v, d, tied, feature == "frozen")).double()
    dense = mm.seeded(0, lambda: _VocabNet(v, d, tied, feature == "frozen")).double()
    emb = VocabParallelEmbedding.from_dense(dense.emb)
    head = ParallelLMHead.from_dense(dense.head, tie_to=emb if tied else None)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, v, (STEPS, 2, 6), generator=g)
    tgt = torch.randint(0, v, (STEPS, 2, 6), generator=g)
    mods = {"emb": emb, "head": head}
    for step in range(STEPS):
        ref.zero_grad()
        for p in list(emb.parameters()) + list(head.parameters()):
            p.grad = None
        ref_loss = F.cross_entropy(ref(ids[step]).reshape(-1, v), tgt[step].reshape(-1))
        ref_loss.backward()
        loss = vocab_parallel_cross_entropy(head(torch.tanh(emb(ids[step]))), tgt[step], v).mean()
        loss.backward()
        if step == 0:
            _close(problems, "loss", loss, ref_loss)
            for key, m in mods.items():
                for n, p in m.named_parameters():
                    if key == "head" and tied and p is emb.weight:
                        continue
                    full = ref.get_parameter(f"{key}.{n}").grad
                    _close(problems, f"gradient of {key}.{n}", p.grad,
                           None if full is None else m.shard_of(full))
        _sgd(list(emb.parameters()) + [p for p in head.parameters() if p is not emb.weight])
        _sgd(ref.parameters())
    for key, m in mods.items():
        for n, p in m.named_parameters():
            _close(problems, f"{key}.{n} after {STEPS} steps", p,
                   m.shard_of(ref.get_parameter(f"{key}.{n}").detach()))


# ---- pipeline schedules ------------------------------------------------------------------------

def _pipeline_case(strategy, feature, rank, ws, problems, index):
    from distlab import pipeline_parallel as pp
    from distlab import pipeline_schedules as ps
    from distlab.models import regression_data
    makers = {**ps.SCHEDULES, **ps.V_SCHEDULES, "DualPipe": ps.dualpipe,
              "interleaved 1F1B": lambda p, m: ps.interleaved_1f1b(p, m, 2)}
    m = 2 * ws
    for k in range(len(mm.PIPELINE_SCHEDULES)):       # this cell's schedule, if p allows it
        name = mm.PIPELINE_SCHEDULES[(index + k) % len(mm.PIPELINE_SCHEDULES)]
        try:
            schedule = makers[name](ws, m)
            break
        except ValueError:
            continue
    v = 1 + max(a.chunk for stage in schedule for a in stage)
    n_pieces = ps.n_pieces(ws, v, ps.placement_of(schedule))
    batch = {"uneven": 4 * ws + 1, "empty": m - 1}.get(feature, 4 * ws)
    x, y = regression_data(batch * STEPS, 8, 8, seed=1)
    batches = [(x[i * batch:(i + 1) * batch].double(), y[i * batch:(i + 1) * batch].double())
               for i in range(STEPS)]
    ref = mm.make_pipe_net(feature, n_pieces)
    expected = []
    for xb, yb in batches:
        ref.zero_grad()
        loss = F.mse_loss(ref(xb), yb)
        loss.backward()
        every = list(ref.named_parameters(remove_duplicate=False))   # tied/reused: each name
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in every}
        _sgd(ref.parameters())
        expected.append((loss.item(), grads, {n: p.detach().clone() for n, p in every}))
    dtype = BF16 if feature == "bf16" else F64
    got = pp.train(rank, ws, lambda p, mb: makers[name](p, mb), mm.make_pipe_net(feature, n_pieces),
                   batches, m, (8,), v=v, lr=LR, dtype=dtype)
    held = sorted(got[0]["grads"])
    for step, (loss, grads, params) in enumerate(expected):
        if got[step]["loss"] is not None:
            _close(problems, f"{name}: loss of step {step}",
                   torch.tensor(got[step]["loss"], dtype=F64), torch.tensor(loss, dtype=F64), dtype)
        for n in held:
            _close(problems, f"{name}: gradient of {n}, step {step}", got[step]["grads"][n],
                   grads[n], dtype)
            _close(problems, f"{name}: {n} after step {step}", got[step]["params"][n], params[n],
                   dtype)
    return held, sorted(grads)


# ---- expert parallel ---------------------------------------------------------------------------

def _ep_case(strategy, feature, rank, ws, problems):
    from distlab.expert_parallel import ExpertParallelMoE, global_name
    from distlab.moe import make_moe_model
    config = dict(in_dim=8, out_dim=4, d_model=8, hidden=8, n_experts=2 * ws, top_k=2)
    counts = [{"uneven": 3 + r, "empty": 0 if r == ws - 1 and ws > 1 else 4}.get(feature, 4)
              for r in range(ws)]
    total = sum(counts)
    g = torch.Generator().manual_seed(7)
    data = [[(torch.randn(c, 8, generator=g, dtype=F64), torch.randn(c, 4, generator=g,
             dtype=F64)) for c in counts] for _ in range(STEPS)]
    ref = make_moe_model(seed=0, dtype=F64, **config)
    dtype = BF16 if feature == "bf16" else F64
    model = make_moe_model(seed=0, dtype=dtype, **config)
    if feature == "frozen":
        ref.moe.router.requires_grad_(False)
        model.moe.router.requires_grad_(False)
    model.moe = ExpertParallelMoE(model.moe)
    first = model.moe.first
    experts = {id(p) for p in model.moe.expert_parameters()}
    for step in range(STEPS):
        ref.zero_grad()
        model.zero_grad()
        outs = [ref(xr)[0] for xr, _ in data[step]]
        sum(((o - yr) ** 2).sum() for o, (_, yr) in zip(outs, data[step])).div(total).backward()
        xr, yr = data[step][rank]
        out = model(xr.to(dtype))[0]
        ((out.to(F64) - yr) ** 2).sum().div(total).backward()
        for p in model.parameters():
            if id(p) not in experts and p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)          # replicated: the sum over the ranks' tokens
        if step == 0:
            _close(problems, "forward output", out, outs[rank], dtype)
            for n, p in model.named_parameters():
                _close(problems, f"gradient of {global_name(n, first)}", p.grad,
                       ref.get_parameter(global_name(n, first)).grad, dtype)
        _sgd(model.parameters())
        _sgd(ref.parameters())
    for n, p in model.named_parameters():
        _close(problems, f"{global_name(n, first)} after {STEPS} steps", p,
               ref.get_parameter(global_name(n, first)), dtype)


# ---- context parallel: ring, all-gather, Ulysses ---------------------------------------------

def _positions(feature, rank, ws):
    from distlab.context_parallel import zigzag_positions
    if feature in ("plain", "bf16"):
        return zigzag_positions(4 * ws, rank, ws), 4 * ws
    if feature == "uneven":                      # 2ws + 1 tokens, contiguous, unequal blocks
        t = 2 * ws + 1
        return torch.tensor_split(torch.arange(t), ws)[rank], t
    # empty: the last rank holds no token
    t = 3 * max(ws - 1, 1)
    return torch.tensor_split(torch.arange(t), max(ws - 1, 1))[rank] if rank < max(ws - 1, 1) \
        else torch.arange(0), t


def _cp_case(strategy, feature, rank, ws, problems):
    from distlab.context_parallel import all_gather_attention, dense_attention, ring_attention
    from distlab.ulysses import ulysses_attention
    fn = {"cp_ring": ring_attention, "cp_allgather": all_gather_attention,
          "ulysses": ulysses_attention}[strategy]
    pos, t = _positions(feature, rank, ws)
    dtype = BF16 if feature == "bf16" else F64
    heads = ws if strategy == "ulysses" else 2
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(1, heads, t, 4, generator=g, dtype=F64) for _ in range(3)]
    probe = torch.randn(1, heads, t, 4, generator=g, dtype=F64)
    mine = [f[:, :, pos].to(dtype) for f in full]
    for step in range(STEPS):
        ref = [f.detach().requires_grad_() for f in full]
        ref_out = dense_attention(*ref, causal=True)
        (ref_out * probe).sum().backward()
        loc = [f.detach().requires_grad_() for f in mine]
        out = fn(*loc, pos, causal=True)
        (out * probe[:, :, pos].to(dtype)).sum().backward()
        if step == 0:
            _close(problems, "forward output", out, ref_out[:, :, pos], dtype)
            for what, a, b in zip("qkv", loc, ref):
                _close(problems, f"gradient of {what}", a.grad, b.grad[:, :, pos], dtype)
        with torch.no_grad():                     # q, k and v as the parameters: SGD on them
            full = [f - LR * r.grad for f, r in zip(full, ref)]
            mine = [f - LR * r.grad for f, r in zip(mine, loc)]
    for what, a, b in zip("qkv", mine, full):
        _close(problems, f"{what} after {STEPS} steps", a, b[:, :, pos], dtype)


# ---- 3D and 4D -----------------------------------------------------------------------------

def _gpt(feature, config):
    from distlab.models import TinyGPT

    def build():
        gpt = TinyGPT(**config).double()
        if feature == "frozen":
            gpt.blocks[0].ln1.requires_grad_(False)
            gpt.blocks[0].attn.qkv.requires_grad_(False)
        if feature == "tied":
            gpt.head.weight = gpt.tok.weight
        return gpt
    return mm.seeded(0, build)


def _3d4d_case(strategy, feature, rank, ws, problems):
    from distlab import parallel3d as p3
    from distlab import parallel4d as p4
    from distlab.models import lm_loss, token_data
    four = strategy == "4d"
    if four:
        dp, pp_, cp, tp = mm.LAYOUT_4D[ws]
        seq = 4 * cp + (1 if feature == "uneven" else 0)
    else:
        (dp, pp_, tp), cp = mm.LAYOUT_3D[ws], 1
        seq = 6
    config = dict(vocab=16, d_model=8, n_heads=2, seq_len=seq,
                  n_layers=5 if feature == "uneven" and not four else max(2, pp_))
    ref = _gpt(feature, config)
    n = dp * pp_
    x, y = token_data(n=n * STEPS, seq_len=seq, vocab=16, seed=1)
    if four:
        mesh = p4.Mesh4D(dp, pp_, cp, tp)
        stage = p4.Stage4D.from_dense(_gpt(feature, config), mesh)
    else:
        mesh = p3.Mesh3D(dp, pp_, tp)
        stage = p3.Stage3D.from_dense(_gpt(feature, config), mesh)
    names = sorted(stage.dense_name(k) for k, _ in stage.named_parameters())
    for step in range(STEPS):
        xb, yb = x[step * n:(step + 1) * n], y[step * n:(step + 1) * n]
        if four:
            loss = p4.train_step(stage, mesh, xb, yb, LR, n_micro=pp_)
        else:
            loss = p3.train_step(stage, mesh, xb, yb, pp_, LR)
        ref.zero_grad()
        ref_loss = lm_loss(ref(xb), yb)
        ref_loss.backward()
        if step == 0:
            _close(problems, "loss", torch.tensor(float(loss), dtype=F64), ref_loss)
            for k, p in stage.named_parameters():
                full = ref.get_parameter(stage.dense_name(k)).grad
                _close(problems, f"gradient of {stage.dense_name(k)}", p.grad,
                       None if full is None else stage.shard_of(k, full))
        _sgd(ref.parameters())
    for k, p in stage.named_parameters():
        _close(problems, f"{stage.dense_name(k)} after {STEPS} steps", p,
               stage.shard_of(k, ref.get_parameter(stage.dense_name(k)).detach()))
    return names, sorted(n for n, _ in ref.named_parameters(remove_duplicate=False))


# ---- one launch per world size -----------------------------------------------------------------

RUNNERS = {**{s: _dp_case for s in mm.DATA_PARALLEL}, "tp": _tp_case, "tp_sp": _tp_case,
           "vocab": _vocab_case, "ep": _ep_case, "3d": _3d4d_case, "4d": _3d4d_case,
           **{s: _cp_case for s in mm.ATTENTION}}


def _run_cells(rank, world_size, cells):
    """Every cell of this world size, in order; per cell: problems, names held, or the error.

    The default process group waits CELL_TIMEOUT seconds in a collective, not 30 minutes: a
    defect that raises on some ranks only leaves the others waiting; they give up, and when any
    rank raised in a cell, every rank meets in a fresh group (through the launcher's store)
    before the next one, instead of pairing the wrong collectives."""
    from datetime import timedelta
    torch.set_num_threads(1)
    store = dist.distributed_c10d._get_default_store()

    def fresh_group(tag):
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"matrix-{tag}", store),
                                rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=CELL_TIMEOUT))
    fresh_group("start")
    out = []
    for index, (strategy, feature, ws) in cells:
        problems, held, error = [], None, None
        started, cpu = time.perf_counter(), time.process_time()
        try:
            torch.manual_seed(0)
            if strategy == "pipeline":
                held = _pipeline_case(strategy, feature, rank, ws, problems, index)
            else:
                held = RUNNERS[strategy](strategy, feature, rank, ws, problems)
        except Exception as e:       # a refusal, or a defect: the parent says which
            error = (type(e).__name__, str(e), traceback.format_exc(limit=-3))
            store.add(f"matrix-raised-{index}", 1)
        # every rank reaches this point (a stuck one after CELL_TIMEOUT): did any raise?
        if store.add(f"matrix-done-{index}", 1) == world_size:    # the last rank here
            store.set(f"matrix-all-{index}", "1")
        store.wait([f"matrix-all-{index}"])
        if int(store.add(f"matrix-raised-{index}", 0)):
            fresh_group(index)
        out.append(dict(problems=problems, held=held, error=error,
                        seconds=time.perf_counter() - started,
                        cpu=time.process_time() - cpu))
    return out


# Defects the matrix found (one line each); the cell turns red when the library is fixed.
DEFECTS = {
}




def _shown_equal(cells):
    return {(s, w) for s, f, w in cells if not mm.expected_refusal(s, f, w)
            and (s, f, w) not in DEFECTS}


# The design, then a plain cell for each (strategy, world size) whose cells are all refusals or
# known defects, so that every strategy is shown equal to one process at every world size.
DESIGN = mm.covering_design()
CELLS = DESIGN + [(s, "plain", w) for s in mm.STRATEGIES for w in mm.WORLD_SIZES
                  if (s, w) not in _shown_equal(DESIGN)]


def _launch(ws, cache={}):
    if ws not in cache:
        cells = [(i, c) for i, c in enumerate(CELLS) if c[2] == ws]
        cache[ws] = dict(zip((i for i, _ in cells),
                             zip(*distlab.run(_run_cells, ws, cells, timeout=120))))
    return cache[ws]


def _reraise(error):
    name, message, where = error
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        raise cls(message)
    raise RuntimeError(f"{name}: {message}\n{where}")


@pytest.fixture(scope="module")
def matrix():
    return _launch


def _params():
    out = []
    for i, (s, f, w) in enumerate(CELLS):
        marks = [pytest.mark.xfail(strict=True, reason=DEFECTS[(s, f, w)])] \
            if (s, f, w) in DEFECTS else []
        out.append(pytest.param(i, id=f"{s}-{f}-ws{w}", marks=marks))
    return out


@pytest.mark.parametrize("index", _params())
def test_cell_equals_one_process_or_is_refused(matrix, index):
    strategy, feature, ws = CELLS[index]
    ranks = matrix(ws)[index]
    refusal = mm.expected_refusal(strategy, feature, ws)
    # the ranks that raised, those that gave up waiting for them last
    errors = sorted((r["error"] for r in ranks if r["error"] is not None),
                    key=lambda e: "Timed out waiting" in e[1])
    if refusal is not None:
        assert len(errors) == ws, f"refused on {len(errors)} of {ws} ranks only"
        with pytest.raises(Exception, match=refusal):
            _reraise(errors[0])
        return
    if errors:
        name, message, where = errors[0]
        pytest.fail(f"{name}: {message}\n{where}")
    for rank, r in enumerate(ranks):
        assert not r["problems"], f"rank {rank}: " + "; ".join(r["problems"][:4])
    if ranks[0]["held"] is not None:            # pipeline, 3D, 4D: every parameter held somewhere
        held = {n for r in ranks for n in r["held"][0]}
        assert held == set(ranks[0]["held"][1]), \
            f"the ranks hold {sorted(held)}; one process has {sorted(ranks[0]['held'][1])}"


# ---- the design itself --------------------------------------------------------------------------

def test_the_design_covers_every_pair_and_is_deterministic():
    covered = set().union(*(mm.pairs_of(c) for c in DESIGN))
    assert mm.required_pairs() <= covered
    assert mm.covering_design() == DESIGN == CELLS[:len(DESIGN)]
    assert len(set(CELLS)) == len(CELLS)
    assert set(DEFECTS) <= set(DESIGN)      # every defect mark sits on a cell of the design
    assert _shown_equal(CELLS) == {(s, w) for s in mm.STRATEGIES for w in mm.WORLD_SIZES}
    every = {(s, f) for s in mm.STRATEGIES for f in mm.FEATURES}
    # every (strategy, feature) pair is in the matrix or said to be out of it, not both
    assert {(s, f) for s in mm.STRATEGIES for f in mm.APPLICABLE[s]} | \
        set(mm.NOT_EXPRESSIBLE) == every
    assert not {(s, f) for s in mm.STRATEGIES for f in mm.APPLICABLE[s]} & \
        set(mm.NOT_EXPRESSIBLE)
