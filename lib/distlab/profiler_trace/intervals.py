"""Interval arithmetic on profiler timestamps (µs)."""


def _subtract(xs, ys):
    """Merged intervals xs minus merged intervals ys."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _cut(a, b, ranges):
    """[a, b] cut where a record_function range begins or ends inside it."""
    points = sorted({p for r in ranges for p in (r["ts"], r["ts"] + r.get("dur", 0))
                     if a < p < b})
    edges = [a] + points + [b]
    return list(zip(edges, edges[1:]))


def _name_at(piece, ranges):
    """The innermost record_function range around the piece, or "compute"."""
    mid = (piece[0] + piece[1]) / 2
    around = [r for r in ranges if r["ts"] <= mid <= r["ts"] + r.get("dur", 0)]
    return min(around, key=lambda r: r.get("dur", 0))["name"] if around else "compute"
