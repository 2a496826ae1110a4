"""The strategies the self-check runs: one function per strategy, each calling
`row(label, fn)` for every row it reports (fn returns the largest difference from the
single-process float64 reference on the CPU), and the table STRATEGIES that names them.

Every function runs on every rank, with the rank's device (`distlab.device()`: cuda:r under NCCL,
the CPU under gloo). Models and tensors are float32 (TF32 off); references float64 on the CPU.
"""
import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..devices import device
from .. import collectives as C
from .. import context_parallel as cpm
from .. import models
from .. import parallel3d as p3
from .. import parallel4d as p4
from .. import pipeline_parallel as pp
from .. import pipeline_schedules as ps
from .. import tensor_parallel as tpm
from ..data_parallel import BucketedDDP, average_gradients, broadcast_parameters, shard_batch
from ..expert_parallel import ExpertParallelMoE
from ..moe import make_moe
from ..sharding import ZeRO

TOL_COLLECTIVE = 1e-5
TOL_MODEL = 1e-4
F64 = torch.float64



# ---- on the rank: comparing, timing --------------------------------------------------------------

def _err(got, ref):
    """Largest |got - ref|, both taken to the CPU in float64."""
    got, ref = got.detach().to("cpu", F64), ref.detach().to("cpu", F64)
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    return (got - ref).abs().max().item() if got.numel() else 0.0


def _worst(pairs):
    return max((_err(g, r) for g, r in pairs), default=0.0)


def _placed(module, dev, what):
    """`module`, after checking that every parameter is on `dev` (a sentence if not)."""
    elsewhere = sorted({str(p.device) for p in module.parameters() if p.device.type != dev.type})
    if elsewhere:
        raise AssertionError(f"{what} left parameters on {', '.join(elsewhere)}; the model it "
                             f"was built from is on {dev}.")
    return module


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)   # NCCL returned at once; wait for the queued work


def _on_rank(rank, world_size, check, cfg):
    """Run `check(rank, world_size, device, row, **cfg)` on this rank; it calls
    row(label, fn) for each row, fn returning the largest error. Returns
    [(row label, device, max error, seconds)]."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = device()
    rows = []

    def row(label, fn, where=None):
        _sync(dev)
        start = time.perf_counter()
        err = float(fn())
        _sync(dev)
        rows.append((label, where or dev.type, err, time.perf_counter() - start))

    check(rank, world_size, dev, row, **cfg)
    return rows


# ---- the collectives of distlab.collectives, and torch's own all_reduce --------------------------

def _data(rank, length):
    return torch.randn(length, generator=torch.Generator().manual_seed(7919 * rank + length))


def _collectives(rank, n, dev, row):
    lengths = (7, 1000)     # 7: uneven (or empty) chunks at most world sizes

    def ring_all_reduce():
        pairs = []
        for length in lengths:
            x = _data(rank, length).to(dev)
            C.ring_all_reduce(x)
            pairs.append((x, sum(_data(r, length).double() for r in range(n))))
        return _worst(pairs)

    def ring_all_gather():
        return _worst((g, _data(r, length)) for length in lengths
                      for r, g in enumerate(C.ring_all_gather(_data(rank, length).to(dev))))

    def ring_reduce_scatter():
        return _worst((C.ring_reduce_scatter(_data(rank, length).to(dev)),
                       sum(_data(r, length).double() for r in range(n)).tensor_split(n)[rank])
                      for length in lengths)

    def tree_broadcast():
        return _worst((C.tree_broadcast(_data(rank, length).to(dev), src=n - 1),
                       _data(n - 1, length)) for length in lengths)

    def all_to_all():
        sizes = [[(3 * i + 5 * j) % 4 for j in range(n)] for i in range(n)]   # uneven, some 0
        pieces = [list(torch.split(_data(i, sum(sizes[i])), sizes[i])) for i in range(n)]
        outs = [torch.empty(sizes[j][rank], device=dev) for j in range(n)]
        C.all_to_all(outs, [p.to(dev) for p in pieces[rank]])
        return _worst((outs[j], pieces[j][rank]) for j in range(n))

    for label, fn in [("ring all-reduce", ring_all_reduce), ("ring all-gather", ring_all_gather),
                      ("ring reduce-scatter", ring_reduce_scatter),
                      ("tree broadcast", tree_broadcast), ("all-to-all", all_to_all)]:
        row(label, fn)


def _builtin_all_reduce(rank, n, dev, row):
    """dist.all_reduce on a tensor of the rank's device and on a CPU tensor, in one run: under
    "cpu:gloo,cuda:nccl" the first goes over NCCL, the second over gloo."""
    expected = sum(_data(r, 1000).double() for r in range(n))

    def on(where):
        x = _data(rank, 1000).to(where)
        dist.all_reduce(x)
        return _err(x, expected)

    row("torch all_reduce, device tensor", lambda: on(dev))
    row("torch all_reduce, CPU tensor", lambda: on("cpu"), where="cpu")


# ---- data parallel, ZeRO -------------------------------------------------------------------------

STEPS = 3


def _sgd_reference(model, batches, loss_fn, lr):
    """Per step the loss, then the final parameters: one process, float64 on the CPU."""
    model = copy.deepcopy(model).to(F64)
    losses = []
    for x, y in batches:
        model.zero_grad()
        x, y = (t.to(F64) if t.is_floating_point() else t for t in (x, y))
        loss = loss_fn(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses, model


def _regression_batches(n, per_rank, in_dim=16, out_dim=4):
    x, y = models.regression_data(n=STEPS * n * per_rank, in_dim=in_dim, out_dim=out_dim, seed=1)
    return models.batches_of(x, y, n * per_rank, STEPS)


def _data_parallel(rank, n, dev, row, kind):
    lr, batches = 0.1, _regression_batches(n, 4)
    dense = models.make_mlp((16, 32, 24, 4), seed=0)
    ref_losses, ref = _sgd_reference(dense, batches, F.mse_loss, lr)

    def train():
        model = copy.deepcopy(dense).to(dev)
        with torch.no_grad():            # a different start on every rank: the broadcast fixes it
            for p in model.parameters():
                p.add_(rank)
        if kind == "naive":
            broadcast_parameters(model)
            wrapped = model
        else:
            wrapped = BucketedDDP(model, bucket_cap_mb=0.001)   # several buckets
        errs = []
        for (x, y), ref_loss in zip(batches, ref_losses):
            model.zero_grad()
            loss = F.mse_loss(wrapped(shard_batch(x, rank, n).to(dev)),
                              shard_batch(y, rank, n).to(dev))
            loss.backward()
            if kind == "naive":
                average_gradients(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
            total = loss.detach().clone()
            dist.all_reduce(total)
            errs.append(abs(total.item() / n - ref_loss))
        return max(errs + [_worst(zip(model.parameters(), ref.parameters()))])

    row(f"{kind} DDP", train)


def _zero(rank, n, dev, row):
    sizes, lr, eps = (5, 12, 7, 3), 0.05, 1e-3   # eps: float32 gradients near 0 stay harmless
    batches = _regression_batches(n, 4, sizes[0], sizes[-1])
    dense = models.make_mlp(sizes, seed=1)
    ref = copy.deepcopy(dense).to(F64)
    opt = torch.optim.Adam(ref.parameters(), lr=lr, eps=eps)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(ref(x.to(F64)), y.to(F64))
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    for stage in (1, 2, 3):
        def train(stage=stage):
            model = copy.deepcopy(dense).to(dev)
            zero = ZeRO(model, stage, optimizer="adam", lr=lr, eps=eps)
            errs = []
            for (x, y), ref_loss in zip(batches, ref_losses):
                zero.zero_grad()
                loss = F.mse_loss(model(x.chunk(n)[rank].to(dev)), y.chunk(n)[rank].to(dev))
                loss.backward()
                zero.step()
                total = loss.detach().clone()
                dist.all_reduce(total)
                errs.append(abs(total.item() / n - ref_loss))
            return max(errs + [_worst(zip(zero.full_parameters(), ref.parameters()))])
        row(f"ZeRO-{stage}", train)


# ---- tensor, pipeline, expert parallel ----------------------------------------------------------

def _tensor_parallel(rank, n, dev, row):
    lr = 0.1
    dense = _seeded(0, lambda: models.Block(4 * n, n, 8 * n))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 2 * n, 4 * n, generator=g), torch.randn(2, 2 * n, 4 * n, generator=g))
            for _ in range(2)]
    ref_losses, ref = _sgd_reference(dense, data, lambda out, t: ((out - t) ** 2).mean(), lr)

    for sp in (False, True):
        def train(sp=sp):
            tp = _placed(tpm.ParallelBlock.from_dense(copy.deepcopy(dense).to(dev), None, sp),
                         dev, "ParallelBlock.from_dense")
            cut = (lambda t: tpm.sequence_slice(t, None)) if sp else (lambda t: t)
            errs = []
            for (x, target), ref_loss in zip(data, ref_losses):
                tp.zero_grad()
                out = tp(cut(x).to(dev))
                loss = ((out - cut(target).to(dev)) ** 2).sum() / target.numel()
                loss.backward()
                with torch.no_grad():
                    for p in tp.parameters():
                        p.add_(p.grad, alpha=-lr)
                total = loss.detach().clone()
                if sp:
                    dist.all_reduce(total)    # each rank's loss covers its part of the sequence
                errs.append(abs(total.item() - ref_loss))
            expected = tpm.dense_shards(tp, ref)
            return max(errs + [_worst((p, expected[k]) for k, p in tp.named_parameters())])
        row("tensor parallel" + (" + sequence parallel" if sp else ""), train)


def _seeded(seed, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _pipeline(rank, n, dev, row):
    lr, m = 0.05, 2 * n                        # m: a multiple of n (interleaved 1F1B)
    sizes = (16,) + (24,) * (n + 1) + (4,)     # 2n + 3 layers: enough for 2 chunks per stage
    batches = _regression_batches(1, 4 * n)
    ref_losses, ref = _sgd_reference(models.make_mlp(sizes, seed=0), batches, F.mse_loss, lr)
    ref_params = dict(ref.named_parameters())
    for name, make in ps.SCHEDULES.items():
        v = 2 if name == "interleaved 1F1B" else 1

        def train(make=make, v=v):
            out = pp.train(rank, n, make, models.make_mlp(sizes, seed=0), batches, m, (16,), v=v,
                           lr=lr)
            errs = [abs(s["loss"] - ref_loss) for s, ref_loss in zip(out, ref_losses)
                    if s["loss"] is not None]
            return max(errs + [_worst((w, ref_params[k]) for k, w in out[-1]["params"].items())])
        row(f"pipeline {name}", train)


def _expert_parallel(rank, n, dev, row):
    def probe(y):     # a different weight per element: a row sent back to the wrong token shows
        return (y * torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype, device=y.device)
                .view_as(y)).sum()

    def tokens(r):
        return torch.randn(12, 8, generator=torch.Generator().manual_seed(100 + r))

    def compare():
        worst = 0.0
        for top_k, capacity in ((1, None), (2, 1.0)):
            moe = make_moe(seed=1, d_model=8, hidden=16, n_experts=2 * n, top_k=top_k,
                           capacity_factor=capacity)
            ref = copy.deepcopy(moe).to(F64)
            xs = [tokens(r).to(F64).requires_grad_() for r in range(n)]
            outs = [ref(x) for x in xs]
            sum(probe(y) + aux for y, aux in outs).backward()

            ep = _placed(ExpertParallelMoE(copy.deepcopy(moe).to(dev)), dev, "ExpertParallelMoE")
            x = tokens(rank).to(dev).requires_grad_()
            y, aux = ep(x)
            (probe(y) + aux).backward()
            router_grads = [p.grad.clone() for p in ep.router.parameters()]
            for grad in router_grads:
                dist.all_reduce(grad)    # the router is replicated: its gradient sums all ranks
            pairs = [(y, outs[rank][0]), (aux, outs[rank][1]), (x.grad, xs[rank].grad)]
            pairs += zip(router_grads, [p.grad for p in ref.router.parameters()])
            for i, expert in enumerate(ep.experts):
                pairs += [(p.grad, q.grad) for p, q in
                          zip(expert.parameters(), ref.experts[ep.first + i].parameters())]
            worst = max(worst, _worst(pairs))
        return worst

    row("expert parallel (MoE all-to-all)", compare)


# ---- 3D and 4D ----------------------------------------------------------------------------------

def layout_3d(n):
    """(dp, pp, tp) for n ranks: pipeline 2 when n is even, then tensor 2, the rest data."""
    pp_ = 2 if n % 2 == 0 else 1
    tp = 2 if (n // pp_) % 2 == 0 else 1
    return n // (pp_ * tp), pp_, tp


def layout_4d(n):
    """(dp, cp, tp) for n ranks: context 2 when n is even, then tensor 2, the rest data."""
    return layout_3d(n)


def _gpt_config(tp, seq_len, n_layers=2):
    heads = 2 * tp
    return dict(vocab=32, d_model=4 * heads, n_heads=heads, n_layers=n_layers, seq_len=seq_len)


def _parallel3d(rank, n, dev, row, dp, pp_, tp):
    lr, n_micro = 0.1, 2
    cfg = _gpt_config(tp, seq_len=8, n_layers=max(2, pp_))
    x, y = models.token_data(n=STEPS * dp * 2 * n_micro, seq_len=8, vocab=32, seed=1)
    batches = models.batches_of(x, y, dp * 2 * n_micro, STEPS)
    ref_losses, ref = _sgd_reference(models.make_gpt(seed=0, **cfg), batches, models.lm_loss, lr)

    def train():
        mesh = p3.Mesh3D(dp, pp_, tp)
        stage = _placed(p3.Stage3D.from_dense(models.make_gpt(seed=0, **cfg), mesh), dev,
                        "Stage3D.from_dense")
        errs = [abs(p3.train_step(stage, mesh, xb, yb, n_micro, lr) - ref_loss)
                for (xb, yb), ref_loss in zip(batches, ref_losses)]
        return max(errs + [_worst((p, stage.shard_of(k, ref.get_parameter(stage.dense_name(k))))
                                  for k, p in stage.named_parameters())])
    row(f"3D (dp={dp} pp={pp_} tp={tp})", train)


def _context_parallel(rank, n, dev, row):
    seq = 4 * n
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq, 4, generator=g) for _ in range(3))
    weights = torch.linspace(-1, 1, q.numel()).view_as(q)
    qd, kd, vd = (t.to(F64).requires_grad_() for t in (q, k, v))
    ref = cpm.dense_attention(qd, kd, vd, causal=True)
    (ref * weights.to(F64)).sum().backward()

    for label, attend in (("ring attention (zig-zag)", cpm.ring_attention),
                          ("all-gather K/V attention", cpm.all_gather_attention)):
        def compare(attend=attend):
            pos = cpm.zigzag_positions(seq, rank, n)
            mine = [t[:, :, pos].to(dev).requires_grad_() for t in (q, k, v)]
            out = attend(*mine, pos.to(dev), causal=True)
            (out * weights[:, :, pos].to(dev)).sum().backward()
            return _worst(zip([out] + [t.grad for t in mine],
                              [t[:, :, pos] for t in (ref, qd.grad, kd.grad, vd.grad)]))
        row(label, compare)


def _parallel4d(rank, n, dev, row, dp, cp, tp):
    lr = 0.1
    cfg = _gpt_config(tp, seq_len=4 * cp)
    x, y = models.token_data(n=2 * dp, seq_len=4 * cp, vocab=32, seed=1)
    ref_losses, ref = _sgd_reference(models.make_gpt(seed=0, **cfg), [(x, y)] * 2,
                                     models.lm_loss, lr)

    def train():
        mesh = p4.Mesh4D(dp, cp, tp)
        model = _placed(p4.ContextParallelGPT.from_dense(models.make_gpt(seed=0, **cfg), mesh),
                        dev, "ContextParallelGPT.from_dense")
        errs = [abs(p4.train_step(model, mesh, x, y, lr) - ref_loss) for ref_loss in ref_losses]
        return max(errs + [_worst((p, model.shard_of(k, ref.get_parameter(k)))
                                  for k, p in model.named_parameters())])
    row(f"4D (dp={dp} cp={cp} tp={tp})", train)


# ---- the table ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Strategy:
    """One line of the table: `check(rank, world_size, device, row, **layout(world_size))`
    reports `rows` (their labels, in order), each passing within `tol`; it needs `needs` ranks."""
    name: str
    rows: tuple
    check: object
    tol: float = TOL_MODEL
    needs: int = 1
    layout: object = None

    def config(self, world_size):
        return self.layout(world_size) if self.layout else {}

    def labels(self, world_size):
        """The row labels, a 3D/4D row naming its layout at this world size."""
        if self.name in ("3D", "4D"):
            cfg = self.config(world_size)
            return [f"{self.name} (" + " ".join(f"{k.rstrip('_')}={v}" for k, v in cfg.items())
                    + ")"]
        return list(self.rows)


STRATEGIES = [
    Strategy("collectives", ("ring all-reduce", "ring all-gather", "ring reduce-scatter",
                             "tree broadcast", "all-to-all"), _collectives, TOL_COLLECTIVE),
    Strategy("torch all_reduce", ("torch all_reduce, device tensor",
                                  "torch all_reduce, CPU tensor"), _builtin_all_reduce,
             TOL_COLLECTIVE),
    Strategy("naive DDP", ("naive DDP",), _data_parallel, layout=lambda n: dict(kind="naive")),
    Strategy("bucketed DDP", ("bucketed DDP",), _data_parallel,
             layout=lambda n: dict(kind="bucketed")),
    Strategy("ZeRO", ("ZeRO-1", "ZeRO-2", "ZeRO-3"), _zero),
    Strategy("tensor parallel", ("tensor parallel", "tensor parallel + sequence parallel"),
             _tensor_parallel),
    Strategy("pipeline", tuple(f"pipeline {s}" for s in ps.SCHEDULES), _pipeline),
    Strategy("expert parallel", ("expert parallel (MoE all-to-all)",), _expert_parallel),
    Strategy("3D", ("3D (dp x pp x tp)",), _parallel3d,
             layout=lambda n: dict(zip(("dp", "pp_", "tp"), layout_3d(n)))),
    Strategy("context parallel", ("ring attention (zig-zag)", "all-gather K/V attention"),
             _context_parallel),
    Strategy("4D", ("4D (dp x cp x tp)",), _parallel4d,
             layout=lambda n: dict(zip(("dp", "cp", "tp"), layout_4d(n)))),
]
