"""USP, unified sequence parallelism: Ulysses inside groups, a ring between them.

Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context Generative AI"
(arXiv:2405.07719); yunchang and xDiT implement it, Megatron-Core as `cp_comm_type="a2a+p2p"`.
The cp ranks form a grid of ring × ulysses = u · r ranks: rank ρ·u + j is member j of Ulysses
group ρ (u consecutive ranks: one node) and member ρ of ring group j (one rank per node).

1. Ulysses' all-to-all inside each Ulysses group (chapter 12's `SequenceToHeads`): every member
   then holds ALL the group's tokens on H/u heads (and K/V heads / u);
2. ring attention (chapter 12's `ring_attention`) over the ring group, whose members hold the
   same heads and the tokens of their own Ulysses groups: blocks u times longer than a rank's;
3. the inverse all-to-all (`HeadsToSequence`) brings the output back to "my tokens, all heads".

Which tokens a rank holds: the course's zig-zag over all u · r ranks (`zigzag_positions(S,
rank, u * r)`), the same blocks pure ring and pure Ulysses use, so the data loader does not
change with the grid. Ulysses group ρ then holds chunks ρ·u … ρ·u + u − 1 of 2ur and their
mirrors: together, chunks ρ and 2r − 1 − ρ of 2r, exactly the ring's zig-zag block. The
all-to-all joins the members' blocks in member order (chunk pieces interleaved: first halves
rising, second halves falling), so the tokens are sorted by position before the ring
(TransformerEngine's `reorder_seq_chunks_for_a2a_before_attn`): the ring then sees two runs of
consecutive positions, and runs its own block as one causal kernel. Any positions stay correct
(the mask comes from them); zig-zag is what balances the ring.

Heads limit u, not u · r: u must divide the query heads and the key/value heads; the ring takes
the rest of the ranks. `communication_per_layer` gives the bytes one rank sends per layer, the
all-to-all's and the ring's apart (the test compares both with a traced run).
"""
from collections import namedtuple

import torch
import torch.distributed as dist

from .. import _argcheck as check
from .. import ulysses
from ..mesh import HandMesh
from .blocks import _check_block
from .exchange import _all_positions, _positions_for
from .ring import _check_log, ring_attention

USPGroups = namedtuple("USPGroups", "ulysses ring ulysses_degree ring_degree")
USPGroups.__doc__ = """This rank's Ulysses group (u consecutive ranks), its ring group (one rank
of each Ulysses group, same member index) and the two degrees."""


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def usp_groups(ulysses_degree, ring_degree):
    """Build every Ulysses group and every ring group of the u × r grid (collective: every rank
    calls it, in the same order) and return this rank's two, as `USPGroups`."""
    world = dist.get_world_size()
    u = check.whole(ulysses_degree, "ulysses_degree", at_least=1)
    r = check.whole(ring_degree, "ring_degree", at_least=1)
    if u * r != world:
        pairs = ", ".join(f"{d}×{world // d}" for d in _divisors(world))
        raise ValueError(f"USP arranges the {world} ranks as ulysses_degree × ring_degree, and "
                         f"{u} × {r} = {u * r} is not {world}: choose a pair whose product is "
                         f"the world size ({pairs}).")
    mesh = HandMesh((r, u), ("ring", "ulysses"))    # rank = ρ·u + j: Ulysses groups consecutive
    return USPGroups(mesh.get_group("ulysses"), mesh.get_group("ring"), u, r)


def check_heads(heads, kv_heads, ulysses_degree, world_size=None):
    """Refuse a Ulysses degree that does not divide the query or key/value heads, in one
    sentence naming the degrees that would (and, given the world size, their ring degrees)."""
    u = check.whole(ulysses_degree, "ulysses_degree", at_least=1)
    heads = check.whole(heads, "heads", at_least=1)
    kv_heads = check.whole(kv_heads, "kv_heads (key/value heads)", at_least=1)
    for name, n in (("query heads", heads), ("key/value heads", kv_heads)):
        if n % u:
            fits = [d for d in _divisors(heads) if kv_heads % d == 0
                    and (world_size is None or world_size % d == 0)]
            grids = ", ".join(f"{d}×{world_size // d}" if world_size else str(d) for d in fits)
            raise ValueError(
                f"USP splits the heads over the ranks of each Ulysses group, and {n} {name} do "
                f"not split over ulysses_degree = {u}: choose a Ulysses degree that divides "
                f"both head counts ({heads} and {kv_heads}) and give the rest of the ranks to "
                f"the ring (ulysses × ring = {grids}).")


def usp_attention(q, k, v, positions, ulysses_group, ring_group, causal=True, log=None):
    """Attention of this rank's tokens over the whole sequence: all-to-all inside the Ulysses
    group, ring attention over the ring group on the group's tokens and this rank's heads,
    all-to-all back. q: (batch, heads, my tokens, head_dim); k, v: (batch, kv_heads, my tokens,
    head_dim), kv_heads dividing heads; ulysses_degree must divide both. `log`, a list, receives
    the ring's `RingStep`s."""
    _check_block(q, k, v, positions)
    _check_log(log)
    for name, g in (("ulysses_group", ulysses_group), ("ring_group", ring_group)):
        if check.group(g, name) is None:
            raise TypeError(f"{name} must be this rank's ProcessGroup (usp_groups(u, r) builds "
                            f"both); None would mean every rank.")
    u = dist.get_world_size(ulysses_group)
    check_heads(q.shape[1], k.shape[1], u, u * dist.get_world_size(ring_group))
    blocks = _all_positions(_positions_for(q, positions), ulysses_group)   # the group's blocks
    lengths = [len(p) for p in blocks]
    held = torch.cat(blocks)                       # this rank's tokens after the all-to-all
    order = torch.argsort(held, stable=True)       # sorted: the ring's zig-zag block, two runs
    back = torch.argsort(order)
    q_h, k_h, v_h = (ulysses.SequenceToHeads.apply(t, lengths, ulysses_group)[:, :, order]
                     for t in (q, k, v))
    out = ring_attention(q_h, k_h, v_h, held[order], causal, ring_group, log)
    return ulysses.HeadsToSequence.apply(out[:, :, back], lengths, ulysses_group)


def communication_per_layer(seq_len, ulysses_degree, ring_degree, heads, kv_heads=None,
                            head_dim=128, itemsize=2, batch=1):
    """Bytes ONE rank sends to others in one attention layer, {"all-to-all": (forward,
    backward), "ring": (forward, backward)}, from `ulysses.communication_per_layer`:

    - the all-to-alls are Ulysses' over u ranks on blocks of S / (u·r) tokens;
    - the ring is chapter 12's over r ranks, on blocks of S / r tokens with H / u heads (and
      K/V heads / u): in bytes the same block as pure ring's at u·r, but r − 1 hops, not
      u·r − 1, each behind u times more attention."""
    u = check.whole(ulysses_degree, "ulysses_degree", at_least=1)
    r = check.whole(ring_degree, "ring_degree", at_least=1)
    kv = kv_heads or heads
    check_heads(heads, kv, u)
    if check.whole(seq_len, "seq_len", at_least=1) % (u * r):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into equal blocks over "
                         f"{u} × {r} = {u * r} ranks: pad it to a multiple of {u * r}.")
    size = dict(head_dim=head_dim, itemsize=itemsize, batch=batch)
    return {"all-to-all": ulysses.communication_per_layer("ulysses", seq_len // r, u, heads, kv,
                                                          **size),
            "ring": ulysses.communication_per_layer("ring", seq_len, r, heads // u, kv // u,
                                                    **size)}
