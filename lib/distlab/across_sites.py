"""Two sites, one slow link between them: the step of DDP, compressed DDP and DiLoCo, modeled.

Each site is a cluster of H100 nodes (the `h100-cluster` preset) that trains its replica with
FSDP inside the site (`hardware.step_seconds(..., fsdp=True)`: the within-site step, its
InfiniBand communication included). Between the sites runs one link of `gbit` Gbit/s with
`rtt_ms` of round-trip latency. A data-parallel step must cross it:

- DDP:            every step, an all-reduce of the bf16 gradients (2 bytes per parameter);
- PowerSGD:       every step, an all-reduce of P and Q at rank r for every weight matrix (bf16);
- DiLoCo (H):     every H steps, an all-reduce of the pseudo-gradients (`bits` per parameter:
                  32 as in the DiLoCo paper, 8 for INTELLECT-1's int8, 4 for Streaming DiLoCo's
                  fp4), so a step pays 1/H of it.

Between two sites an all-reduce is a ring of two: each site sends its half and receives the other
half twice (reduce-scatter, then all-gather), so S bytes cross each direction of the link. The
cross-site time is charged after the step, not hidden behind backward (DDP's would hide only as
much as one backward lasts; DiLoCo's could hide behind the next inner steps, which is what
Streaming DiLoCo's overlap does: `emulated_overlap` runs it). The numbers are modeled with the
course's hardware model, not measured: every table built from them says so.

`emulated_step_times` runs the same comparison as code under the emulator: two ranks, each one
site, on a Cluster whose only link between "nodes" is the sites' link; a site's step is charged
from the closed form (`distlab.trace.compute`), the cross-site traffic by the all-reduces the
code issues on meta tensors at full size — DiLoCo's through the course's `diloco.DiLoCo` itself.
"""
from dataclasses import dataclass

from . import hardware
from .compression import payload_bytes

GBIT = 1e9 / 8              # bytes/s per Gbit/s

# The cross-site links, as port speeds one can lease: AWS Direct Connect's pricing page
# (aws.amazon.com/directconnect/pricing) lists "Dedicated connection 1 Gbps", "10 Gbps",
# "100 Gbps" (and "400 Gbps") port hours. These are LINE RATES: what an all-reduce achieves over
# a wide-area TCP path is lower (ESTIMATE: the model charges the line rate, an upper bound).
LINK_GBIT = (1, 10, 100)
# Round trip between two sites of one continent: Azure's "network round-trip latency statistics"
# page (learn.microsoft.com/azure/networking/azure-network-latency, October 2019 figures):
# "5 ms to 72 ms for round trips within North America regions", "3 ms to 28 ms ... within
# Europe", "4 ms to 134 ms ... within Asia". We take 72 ms: two sites a continent apart.
RTT_MS = 72.0

# INTELLECT-1 (arXiv:2412.01152): a 10B Llama-3-style model (42 layers, hidden 4096, 32 heads,
# 8 key/value heads, SwiGLU feed-forward 14336, vocabulary 128256: the report's appendix A).
INTELLECT_1 = hardware.Transformer(42, 4096, 32, 14336, 128256, kv_heads=8, glu=True)
# A 1B model of the same family (Llama-3.2 1B's shape: 16 layers, hidden 2048, 32 heads, 8 KV).
LLAMA_1B = hardware.Transformer(16, 2048, 32, 8192, 128256, kv_heads=8, glu=True)


def matrices(model):
    """The weight matrices (rows, cols) of a hardware.Transformer: per layer q, k, v, o and the
    feed-forward's two or three; the embedding and the output head."""
    h, kv = model.hidden, (model.kv_heads or model.heads) * model.hidden // model.heads
    layer = [(h, h), (kv, h), (kv, h), (h, h)] + [(model.ffn, h)] * (3 if model.glu else 2)
    return layer * model.layers + [(model.vocab, h)] * 2


def powersgd_numbers(model, rank):
    """Numbers PowerSGD sends per step at `rank`, as (in P, in Q): n r and m r per matrix (a
    matrix where (n + m) r would not save anything goes whole, counted with P)."""
    p = q = 0
    for n, m in matrices(model):
        r = min(rank, n, m)
        if (n + m) * r < n * m:
            p, q = p + n * r, q + m * r
        else:
            p += n * m
    return p, q


@dataclass(frozen=True)
class Sites:
    """Two sites of `gpus` H100s each, joined by a link of `gbit` Gbit/s and `rtt_ms` RTT
    (defaults: a 10 Gbit/s leased port and Azure's 72 ms North-American round trip, above)."""
    gpus: int = 64              # ESTIMATE: 8 nodes of 8 H100s a site, a size chosen for the chapter
    gbit: float = 10.0
    rtt_ms: float = RTT_MS

    def __post_init__(self):
        for name in ("gpus", "gbit", "rtt_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                    or (name == "gpus" and not isinstance(v, int)):
                raise ValueError(f"Sites: {name} must be a positive "
                                 f"{'whole number' if name == 'gpus' else 'number'}; got {v!r}.")

    def link(self):
        return hardware.Link(f"{self.gbit:g} Gbit/s between sites, {self.rtt_ms:g} ms RTT",
                             bandwidth=self.gbit * GBIT, latency=self.rtt_ms / 1e3,
                             source="port speed: AWS Direct Connect's 1/10/100 Gbps ports; RTT: "
                                    "Azure's inter-region round-trip statistics")

    def cross(self, nbytes):
        """Seconds of an all-reduce of `nbytes` between the two sites (a ring of two)."""
        return self.link().seconds("all_reduce", nbytes, 2)


def inner_step(model, sites, tokens_per_site, seq_len=4096):
    """Modeled seconds of one step inside one site: FSDP over its GPUs, full recompute."""
    cluster = hardware.PRESETS["h100-cluster"]
    return hardware.step_seconds(model, cluster, sites.gpus, tokens_per_site // seq_len, seq_len,
                                 fsdp=True, recompute="full")["step"]


def step_times(model, sites, tokens_per_site=2 ** 21, Hs=(10, 100, 500), rank=4, bits=32):
    """{method: (seconds per step, compute utilisation)} for DDP, PowerSGD at `rank`, and DiLoCo
    at each H of `Hs` with pseudo-gradients of `bits` bits: all modeled."""
    compute = inner_step(model, sites, tokens_per_site)
    params = model.params()
    out = {"DDP (bf16 gradients)": compute + sites.cross(2 * params),
           f"PowerSGD rank {rank} (bf16)": compute + sum(       # P, then Q: two all-reduces
               sites.cross(2 * n) for n in powersgd_numbers(model, rank))}
    for H in Hs:
        out[f"DiLoCo H={H} ({bits}-bit)"] = compute + sites.cross(payload_bytes(params, bits)) / H
    return {k: (v, compute / v) for k, v in out.items()}, compute


def break_even_H(model, sites, utilisation, tokens_per_site=2 ** 21, bits=32):
    """The smallest H at which DiLoCo keeps `utilisation` of the compute (modeled)."""
    compute = inner_step(model, sites, tokens_per_site)
    sync = sites.cross(payload_bytes(model.params(), bits))
    # compute / (compute + sync / H) >= u  <=>  H >= sync * u / (compute * (1 - u))
    import math
    return max(1, math.ceil(sync * utilisation / (compute * (1 - utilisation)) - 1e-9))


def link_for(model, utilisation, H, bits, sites=Sites(), tokens_per_site=2 ** 21):
    """The link speed (Gbit/s) at which DiLoCo keeps `utilisation` of the compute with H inner
    steps and `bits`-bit pseudo-gradients (modeled): compute / (compute + sync / H) = u gives
    the sync time the link may take, latency included."""
    compute = inner_step(model, sites, tokens_per_site)
    sync = H * compute * (1 - utilisation) / utilisation
    seconds_for_bytes = sync - sites.rtt_ms / 1e3
    if seconds_for_bytes <= 0:
        raise ValueError(f"at H={H} the link's latency alone exceeds the sync time allowed")
    return payload_bytes(model.params(), bits) / seconds_for_bytes / GBIT


def two_site_cluster(sites):
    """The emulator's view of two sites: two 'nodes' of one rank each (a rank stands for a whole
    site), joined by nothing but the sites' link (the legacy one-link model: nics_per_node=None)."""
    return hardware.Cluster("two sites, one rank each", hardware.H100, hardware.NVLINK4,
                            sites.link(), ranks_per_node=1, nodes=2,
                            source="distlab.across_sites: one rank per site")


def _emulated(rank, world_size, compute, params, pq, Hs, steps):
    """One rank = one site: each step charges the site's compute (closed form), then issues the
    cross-site traffic on meta tensors at full size. Returns seconds per step by method."""
    import torch
    import torch.distributed as dist
    from . import diloco, trace

    def per_step(n, after_compute):
        start = trace.now()
        for _ in range(n):
            trace.compute(compute, "a site's step")
            after_compute()
        return (trace.now() - start) / n

    grads = torch.empty(params, dtype=torch.bfloat16, device="meta")
    out = {"DDP": per_step(steps, lambda: dist.all_reduce(grads))}
    p, q = (torch.empty(n, dtype=torch.bfloat16, device="meta") for n in pq)
    out["PowerSGD"] = per_step(steps, lambda: (dist.all_reduce(p), dist.all_reduce(q)))
    for H in Hs:                # the course's DiLoCo, on a full-size fp32 replica on meta
        replica = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(params, device="meta"))])
        out[H] = per_step(H, diloco.DiLoCo(replica, H, outer=diloco.plain_average).step)
    return out


def emulated_step_times(model, sites, tokens_per_site=2 ** 21, Hs=(10, 100, 500), rank=4,
                        steps=4):
    """`step_times`' table (fp32 pseudo-gradients), run as code under the emulator on
    `two_site_cluster(sites)`: {method: seconds per step} (emulated, not measured)."""
    import distlab
    compute = inner_step(model, sites, tokens_per_site)
    got = distlab.run(_emulated, 2, compute, model.params(), powersgd_numbers(model, rank),
                      tuple(Hs), steps, emulate=two_site_cluster(sites), timeout=120)[0]
    out = {"DDP (bf16 gradients)": got["DDP"], f"PowerSGD rank {rank} (bf16)": got["PowerSGD"]}
    out.update({f"DiLoCo H={H} (32-bit)": got[H] for H in Hs})
    return out


def _emulated_overlap(rank, world_size, compute, params, H, fragments, taus):
    """One rank = one site running streaming DiLoCo (the course's, on a meta replica cut into
    `fragments` tensors) with each overlap τ: seconds per step over a second period of H steps
    (the first fills the pipeline)."""
    import torch
    from . import diloco, trace
    out = {}
    for tau in taus:
        replica = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(
            params // fragments, device="meta")) for _ in range(fragments)])
        wrap = diloco.DiLoCo(replica, H, diloco.plain_average, fragments, overlap=tau)
        for _ in range(2):
            start = trace.now()
            for _ in range(H):
                trace.compute(compute, "a site's step")
                wrap.step()
        out[tau] = (trace.now() - start) / H
        wrap.finish()
    return out


def emulated_overlap(model, sites, H=100, fragments=4, taus=(0, 1, 2), tokens_per_site=2 ** 21):
    """Streaming DiLoCo (fp32 pseudo-gradients, `fragments` fragments, H) under the emulator on
    `two_site_cluster(sites)`, each fragment's all-reduce overlapped with τ inner steps for each
    τ of `taus`: ({τ: seconds per step}, a site's step alone) — emulated, not measured."""
    import distlab
    compute = inner_step(model, sites, tokens_per_site)
    got = distlab.run(_emulated_overlap, 2, compute, model.params(), H, fragments, tuple(taus),
                      emulate=two_site_cluster(sites), timeout=120)[0]
    return got, compute
