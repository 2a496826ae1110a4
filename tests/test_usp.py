"""USP (`context_parallel.usp`): Ulysses' all-to-all inside groups of u ranks, ring attention
between them. Equal to one process's attention (output and every gradient, float64) on the grids
2×2, 2×3, 3×2 and the degenerate 1×4 (pure ring) and 4×1 (pure Ulysses); grouped-query heads,
blocks of unequal length, no causal mask; the bytes each rank sends by the all-to-all and by
the ring are the closed form's, inside the right groups; the ring gets zig-zag's blocks of r
ranks; bad input is refused in a sentence. One launch per world size."""
import json
from pathlib import Path

import pytest
import torch

import distlab
from distlab import context_parallel as cp
from distlab import ulysses
from distlab.context_parallel import usp

B, D = 1, 4

# name: (ulysses degree, ring degree, heads, kv_heads, seq_len, layout, causal)
CASES = {
    4: {"2x2 gqa": (2, 2, 4, 2, 16, "zigzag", True),
        "2x2 uneven, not causal": (2, 2, 2, 2, 17, "uneven", False),   # 17 on 4: 5, 4, 4, 4
        "1x4 pure ring, gqa": (1, 4, 2, 1, 16, "zigzag", True),
        "4x1 pure ulysses": (4, 1, 4, 4, 16, "zigzag", True)},
    6: {"2x3 gqa": (2, 3, 4, 2, 24, "zigzag", True),
        "3x2 gqa": (3, 2, 6, 3, 24, "zigzag", True),
        "3x2 uneven": (3, 2, 3, 3, 25, "uneven", True)},
}


def _positions(seq_len, layout, rank, world_size):
    if layout == "zigzag":
        return cp.zigzag_positions(seq_len, rank, world_size)
    return torch.arange(seq_len).tensor_split(world_size)[rank]


def _inputs(seq_len, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, seq_len, D, dtype=torch.float64, generator=g)
            for h in (heads, kv_heads, kv_heads)]


def _weights(heads, seq_len):
    return torch.linspace(-1, 1, B * heads * seq_len * D, dtype=torch.float64).view(
        B, heads, seq_len, D)


def _dense(heads, kv_heads, seq_len, causal):
    q, k, v = [t.requires_grad_() for t in _inputs(seq_len, heads, kv_heads)]
    out = cp.dense_attention(q, *(t.repeat_interleave(heads // kv_heads, 1) for t in (k, v)),
                             causal=causal)
    (out * _weights(heads, seq_len)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _refusals(groups):
    said = {}
    zeros = [torch.zeros(B, 3, 4, D)] * 3
    for name, call in {
            "heads": lambda: usp.usp_attention(*zeros, torch.arange(4), *groups[:2]),
            "kv_heads": lambda: usp.usp_attention(torch.zeros(B, 4, 4, D),
                                                 *[torch.zeros(B, 1, 4, D)] * 2, torch.arange(4),
                                                 *groups[:2]),
            "no group": lambda: usp.usp_attention(*[torch.zeros(B, 2, 4, D)] * 3, torch.arange(4),
                                                 None, groups.ring),
            "grid": lambda: usp.usp_groups(4, 2)}.items():
        try:
            call()
            said[name] = None
        except (TypeError, ValueError) as e:
            said[name] = str(e)
    return said


def _usp(rank, world_size, cases):
    grids, results = {}, {}
    for u, r, *_ in cases.values():            # every rank builds every grid, in one order
        if (u, r) not in grids:
            grids[u, r] = usp.usp_groups(u, r)
    for name, (u, r, heads, kv_heads, seq_len, layout, causal) in cases.items():
        positions = _positions(seq_len, layout, rank, world_size)
        q, k, v = [t[:, :, positions].clone().requires_grad_()
                   for t in _inputs(seq_len, heads, kv_heads)]
        log = []
        with distlab.trace.span(name):
            out = usp.usp_attention(q, k, v, positions, grids[u, r].ulysses, grids[u, r].ring,
                                   causal=causal, log=log)
            (out * _weights(heads, seq_len)[:, :, positions]).sum().backward()
        results[name] = (positions, (out.detach(), q.grad, k.grad, v.grad),
                         [(s.block, s.pairs, s.kernels) for s in log])
    return results, _refusals(grids[2, world_size // 2])


@pytest.fixture(scope="module", params=sorted(CASES))
def launched(request):
    world_size = request.param
    return world_size, distlab.run(_usp, world_size, CASES[world_size], trace=True, timeout=120)


def test_usp_equals_one_process_on_every_grid(launched):
    world_size, run = launched
    for name, (u, r, heads, kv_heads, seq_len, layout, causal) in CASES[world_size].items():
        expected = _dense(heads, kv_heads, seq_len, causal)
        for rank, (results, _) in enumerate(run):
            positions, got, _ = results[name]
            for what, g, e in zip(("output", "dq", "dk", "dv"), got, expected):
                assert g is not None, f"{name}, rank {rank}: no {what}"
                torch.testing.assert_close(g, e[:, :, positions], rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"{name}, rank {rank}, {what}: {m}")


def test_the_ring_gets_zigzag_blocks_of_r_ranks(launched):
    """After the all-to-all (and the sort) ring member ρ holds chunks ρ and 2r−1−ρ of 2r: every
    step plans exactly what pure ring attention on r ranks plans, one kernel per block."""
    world_size, run = launched
    for name, (u, r, _, _, seq_len, layout, causal) in CASES[world_size].items():
        if layout != "zigzag":
            continue
        zz = [cp.zigzag_positions(seq_len, rho, r) for rho in range(r)]
        for rank, (results, _) in enumerate(run):
            rho = rank // u
            expected = [((rho - s) % r, cp.plan_work(p), sum(len(pieces) for _, pieces in p))
                        for s in range(r)
                        for p in [cp.block_plan(zz[rho], zz[(rho - s) % r], causal)]]
            assert results[name][2] == expected, f"{name}, rank {rank}"


def _sent(trace, rank, name):
    """(bytes sent to others by the all-to-alls, by the ring's messages) inside span `name`,
    with the groups and peers they went to."""
    events = [e for e in trace.comm(rank) if e["label"] == [name]]
    a2a = [e for e in events if e["op"] == "all_to_all"]
    sends = [e for e in events if e["op"] == "send"]
    assert {e["op"] for e in events} <= {"all_gather", "all_to_all", "send", "recv"}, name
    return (sum(e["bytes"] * (len(e["group"]) - 1) // len(e["group"]) for e in a2a),
            sum(e["bytes"] for e in sends),
            {tuple(e["group"]) for e in a2a}, {e["peer"] for e in sends})


def test_each_rank_sends_the_closed_form_inside_its_groups(launched):
    """The all-to-all stays inside the Ulysses group (u consecutive ranks: one node), the ring's
    messages go to the next member of the ring group; their bytes are the closed form's."""
    world_size, run = launched
    for name, (u, r, heads, kv_heads, seq_len, layout, _) in CASES[world_size].items():
        if layout != "zigzag":          # uneven blocks split the all-to-all unevenly
            continue
        closed = usp.communication_per_layer(seq_len, u, r, heads, kv_heads, D, itemsize=8,
                                             batch=B)
        for rank in range(world_size):
            rho, j = divmod(rank, u)
            a2a, ring, groups, peers = _sent(run.trace, rank, name)
            assert (a2a, ring) == (sum(closed["all-to-all"]), sum(closed["ring"])), (name, rank)
            assert groups <= {tuple(range(rho * u, rho * u + u))}, (name, rank, groups)
            assert peers <= {((rho + 1) % r) * u + j}, (name, rank, peers)
        # the degenerate grids are the pure ways, byte for byte
        pure = {1: "ring", world_size: "ulysses"}.get(u)
        if pure:
            assert sum(closed["ring"] if pure == "ring" else closed["all-to-all"]) == sum(
                ulysses.communication_per_layer(pure, seq_len, world_size, heads, kv_heads, D,
                                                itemsize=8, batch=B))


def test_bad_input_is_refused_in_a_sentence(launched):
    world_size, run = launched
    for _, said in run:
        assert ("3 query heads do not split over ulysses_degree = 2: choose a Ulysses degree "
                "that divides both head counts (3 and 3)") in said["heads"]
        grids = {4: "1×4", 6: "1×6, 3×2"}[world_size]     # u dividing 3 heads and the world
        assert said["heads"].endswith(f"(ulysses × ring = {grids}).")
        assert "1 key/value heads do not split over ulysses_degree = 2" in said["kv_heads"]
        assert said["no group"].startswith("ulysses_group must be this rank's ProcessGroup")
        assert f"4 × 2 = 8 is not {world_size}: choose a pair" in said["grid"]
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        usp.communication_per_layer(18, 2, 2, 4)


# ---- chapter 12b's section 4 (stale prose fails) -------------------------------------------------

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "12b_cp_at_scale.ipynb"


def test_the_full_size_bytes_the_chapter_quotes():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    prose = " ".join(" ".join("".join(c["source"]) for c in cells
                              if c["cell_type"] == "markdown").split())
    # section 4's run: 32 tokens on 4 ranks, 4 heads of 8, float64
    toy = {way: sum(ulysses.communication_per_layer(way, 32, 4, 4, 4, 8, itemsize=8))
           for way in ("ring", "ulysses")}
    both = usp.communication_per_layer(32, 2, 2, 4, 4, 8, itemsize=8)
    assert f"USP sends {sum(map(sum, both.values())):,.0f} bytes per rank against the ring's " \
           f"{toy['ring']:,.0f} and Ulysses' {toy['ulysses']:,.0f}: {sum(both['ring']):,.0f} by " \
           f"its ring" in prose
    # unsorted, the ring's plan at 2 x 2 on 32 tokens: the group's blocks in member order
    held = [torch.cat([cp.zigzag_positions(32, rho * 2 + j, 4) for j in range(2)])
            for rho in range(2)]
    kernels = [sum(len(p) for _, p in cp.block_plan(held[rho], held[(rho - s) % 2], True))
               for rho in range(2) for s in range(2)]
    assert f"its steps would run {', '.join(map(str, kernels[:-1]))} and {kernels[-1]} " \
           f"kernels (ring members 0 and 1, in step order) where the sorted blocks run 1 " \
           f"each" in prose
    mib, s = 2 ** 20, 131_072
    c = usp.communication_per_layer(s, 8, 2, 128, 8)
    ring = sum(ulysses.communication_per_layer("ring", s, 16, 128, 8)) / mib
    for text in (f"{sum(c['all-to-all']) / mib:,.0f} MiB by the all-to-all inside the node",
                 f"{sum(c['ring']) / mib:,.0f} MiB by the ring across nodes",
                 f"pure ring's {ring:,.0f} MiB"):
        assert text in prose, f"chapter 12b's prose no longer says {text!r}: recompute and fix it"
