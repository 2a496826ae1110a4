"""What attention of one block of queries over one block of keys must compute under a causal
mask, from positions alone: pieces to skip, to run in full, or to halve (a causal kernel)."""
from .. import _argcheck as check


def _runs(positions):
    """The block's runs of consecutive positions, as (first token, end token, first position):
    a contiguous block is one run, a zig-zag block two. Worked out on the host (numpy), once per
    call: a real implementation knows its layout and launches no kernel for this."""
    if positions.device.type == "meta":
        raise ValueError("positions must be real integers even when q, k and v are meta "
                         "tensors: the mask (which blocks to compute, skip or halve) is built "
                         "from them.")
    p = positions.detach().cpu().numpy().astype("int64")
    runs, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            runs.append((start, i, int(p[start])))
            start = i
    return tuple(runs)


def _bounds(runs):
    """The positions where runs begin and where they end (one past their last)."""
    return sorted({f for _, _, f in runs} | {f + b - a for a, b, f in runs})


def _cut(runs, points):
    """`runs` split at the given positions."""
    out = []
    for a, b, f in runs:
        inside = [p for p in points if f < p < f + b - a]
        for lo, hi in zip([f] + inside, inside + [f + b - a]):
            out.append((a + lo - f, a + hi - f, lo))
    return tuple(out)


# What a (query run, key run) pair needs under a causal mask, from positions alone:
FULL, SKIP, DIAGONAL, PARTIAL = "full", "skip", "diagonal", "partial"


def _pair(qrun, krun, causal):
    """FULL: every key precedes every query; SKIP: every key follows every query (fully masked,
    nothing to compute); DIAGONAL: the same tokens on both sides (a square causal block: half
    the work); PARTIAL: anything else (an explicit mask)."""
    if not causal:
        return FULL
    (qa, qb, qf), (ka, kb, kf) = qrun, krun
    q_last, k_last = qf + qb - qa - 1, kf + kb - ka - 1
    if k_last <= qf:
        return FULL
    if kf > q_last:
        return SKIP
    if kf == qf and kb - ka == qb - qa:
        return DIAGONAL
    return PARTIAL


def block_plan(q_pos, k_pos, causal):
    """What attention of a block of queries over a block of keys computes: a list of
    (query rows, [(key columns, kind), ...]) with kind FULL or DIAGONAL (flash kernels, causal
    when DIAGONAL) or PARTIAL (a masked kernel); fully masked pairs are left out, and query rows
    that see no key of the block are not listed. Adjacent query runs that see the same keys
    share one kernel, and so do adjacent key runs they see in full."""
    check.integers(q_pos, "q_pos (the queries' positions)")
    check.integers(k_pos, "k_pos (the keys' positions)")
    stripes = _stripes(q_pos, k_pos) if causal else None
    if stripes is not None:
        return stripes
    qruns, kruns = _runs(q_pos), _runs(k_pos)
    if causal and qruns and qruns == kruns and all(a[2] < b[2] for a, b in zip(qruns, qruns[1:])):
        # A block against itself, positions increasing: key j is visible to query i exactly when
        # j ≤ i, one causal kernel (a zig-zag block's two chunks in one, its work c²/2 as theirs)
        n = qruns[-1][1]
        return [((0, n), [((0, n), DIAGONAL)])]
    if causal:
        # cut each side's runs where the other side's runs begin and end: every pair of pieces
        # then covers the same positions (DIAGONAL) or disjoint ones (FULL or SKIP), and none
        # needs an explicit mask (all-gather's joined K: chunks 3 and 4 of zig-zag are one run)
        qruns, kruns = _cut(qruns, _bounds(kruns)), _cut(kruns, _bounds(qruns))
    return _join([(qrun, tuple(_pair(qrun, krun, causal) for krun in kruns)) for qrun in qruns],
                 kruns)


def _join(rows, kruns):
    """The plan of (query run, kinds against every key run) rows: adjacent query runs that see
    the same keys share one kernel (not across a DIAGONAL or PARTIAL one), and so do adjacent
    key runs seen in full; SKIP pairs are left out, and so are rows that see nothing."""
    groups = []
    for qrun, kinds in rows:
        if groups and groups[-1][1] == kinds and DIAGONAL not in kinds and PARTIAL not in kinds:
            groups[-1][0][1] = qrun[1]                   # extend the previous row group
        else:
            groups.append(([qrun[0], qrun[1]], kinds))
    plan = []
    for (qa, qb), kinds in groups:
        pieces = []
        for (ka, kb, _), kind in zip(kruns, kinds):
            if kind == SKIP:
                continue
            if kind == FULL and pieces and pieces[-1][1] == FULL and pieces[-1][0][1] == ka:
                pieces[-1] = ((pieces[-1][0][0], kb), FULL)
            else:
                pieces.append(((ka, kb), kind))
        if pieces:
            plan.append(((qa, qb), pieces))
    return plan


def _stripes(q_pos, k_pos):
    """The plan of two striped blocks (stride N, offsets below N, as many keys as queries), or
    None. Query i (position i·N + a) sees key j (j·N + b) when j ≤ i if b ≤ a: one causal
    kernel; when j < i if b > a: one causal kernel of queries 1.. against keys ..c−1."""
    if q_pos.device.type == "meta" or len(q_pos) < 2 or len(q_pos) != len(k_pos):
        return None
    q, k = q_pos.detach().cpu().numpy(), k_pos.detach().cpu().numpy()
    stride = int(q[1] - q[0])
    if stride < 2 or not all(((x[1:] - x[:-1]) == stride).all() and 0 <= x[0] < stride
                             for x in (q, k)):
        return None
    c = len(q)
    if k[0] <= q[0]:
        return [((0, c), [((0, c), DIAGONAL)])]
    return [((1, c), [((0, c - 1), DIAGONAL)])]


def plan_work(plan):
    """The query-key pairs a plan's kernels compute: rows × columns of each FULL or PARTIAL
    piece, half of a DIAGONAL one (what a causal flash kernel charges)."""
    total = 0.0
    for (qa, qb), pieces in plan:
        for (ka, kb), kind in pieces:
            total += (qb - qa) * (kb - ka) * (0.5 if kind == DIAGONAL else 1.0)
    return total
