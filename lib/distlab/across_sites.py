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
Streaming DiLoCo's overlap does — not modeled). The numbers are modeled with the course's
hardware model, not measured: every table built from them says so.
"""
from dataclasses import dataclass

from . import hardware

GBIT = 1e9 / 8              # bytes/s per Gbit/s

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
    """Two sites of `gpus` H100s each, joined by a link of `gbit` Gbit/s and `rtt_ms` RTT."""
    gpus: int = 64
    gbit: float = 10.0
    rtt_ms: float = 50.0

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
                             source="assumed (see the chapter): a leased wide-area link")

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
        out[f"DiLoCo H={H} ({bits}-bit)"] = compute + sites.cross(params * bits / 8) / H
    return {k: (v, compute / v) for k, v in out.items()}, compute


def break_even_H(model, sites, utilisation, tokens_per_site=2 ** 21, bits=32):
    """The smallest H at which DiLoCo keeps `utilisation` of the compute (modeled)."""
    compute = inner_step(model, sites, tokens_per_site)
    sync = sites.cross(model.params() * bits / 8)
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
    return model.params() * bits / 8 / seconds_for_bytes / GBIT
