"""ZB's split backward: I (the input's gradient, and the gradient at every layer output that
feeds a weight), then W (each weight's gradient from those), over a retained graph."""
import torch


def _input_gradients(s):
    """I: the input's gradient (asking for the stage's anchor runs the input's node, which keeps
    it: see stage._StageInput), and on the way the gradient at every layer output that feeds a
    weight (what W needs): autograd skips the weight-gradient products, which nothing asked for.
    retain_graph: W reuses the graph."""
    # the first stage has no anchor; its input needs a gradient when the batch does (as B's)
    first = [s["inp"]] if "anchor" not in s and s["inp"].requires_grad else []
    want = ([s["anchor"]] if "anchor" in s else first) + [o for _, o in s["layers"]]
    got = torch.autograd.grad(_vjp_root(s["out"], s["grad"]), want, retain_graph=True,
                              allow_unused=True) if want else []
    if first:
        s["in_grad"] = got[0]
    s["layer_grads"] = list(got[1:] if "anchor" in s or first else got)


class _weight_inputs:
    """Inside `with`: record the output of every module of `part` that owns weights (its own,
    not its children's), as (module, output). ZB's split backward then works layer by layer, as
    production implementations do: I stops at these outputs, W multiplies each by its layer's
    input — one weight-gradient product per layer, nothing of the input-gradient work redone."""

    def __init__(self, part):
        self.layers = [m for m in part.modules()
                       if any(q.requires_grad for q in m.parameters(recurse=False))]
        self.outputs = []

    def __enter__(self):
        def keep(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                self.outputs.append((module, output))
        self.handles = [m.register_forward_hook(keep) for m in self.layers]
        return self.outputs

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _weight_gradients(part, s):
    """W: every weight's gradient from the gradients I left at the layer outputs (the cuts),
    accumulated into .grad as autograd would.

    I's gradient at a cut is its total, every use below it included. So each cut contributes
    only through the paths to a weight that cross no other cut: a layer used twice, or two
    layers sharing a weight, has its first use reached from the second use's cut too, and that
    use is already the first cut's share (walking into it counted it twice). Cuts met on the way
    are held at zero while another cut's share is taken. The stage's output is a cut as well,
    so a weight used outside any recorded layer (a module that returns a tuple) still gets its
    share, and every path from the loss to a weight is counted exactly once.
    """
    params = {id(q): q for q in part.parameters() if q.requires_grad}
    cuts = [(o, g) for (_, o), g in zip(s.get("layers", []), s.get("layer_grads", []))]
    if s["out"].requires_grad and not any(o is s["out"] for o, _ in cuts):
        cuts.append((s["out"], s["grad"]))
    cuts = [(o, g) for o, g in cuts if g is not None or o.dim() == 0]
    if not params or not cuts:
        return
    edges = {_edge(o) for o, _ in cuts}
    root = [None]

    def only_from_root(o):
        return lambda grad: None if root[0] is o else torch.zeros_like(grad)
    handles = [o.register_hook(only_from_root(o)) for o, _ in cuts]
    try:
        for o, g in cuts:
            mine = _reachable(_edge(o)[0], edges, params)
            if not mine:
                continue
            root[0] = o
            for q, dq in zip(mine, torch.autograd.grad(o, mine, g, retain_graph=True,
                                                       allow_unused=True)):
                if dq is not None:
                    q.grad = dq if q.grad is None else q.grad + dq
    finally:
        for h in handles:
            h.remove()


def _edge(t):
    """Where autograd's graph receives t's gradient: (node, input number), as next_functions
    names it (a GradientEdge also carries a token that next_functions' pairs do not)."""
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


def _reachable(node, cuts, params):
    """The parameters (of `params`, by id) that autograd's graph reaches from `node` without
    passing through an edge in `cuts`."""
    found, seen, todo = {}, set(), [node]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":     # a leaf tensor's end of the graph
            leaf = node.variable
            if id(leaf) in params:
                found[id(leaf)] = leaf
            continue
        todo += [n for n, nr in node.next_functions if n is not None and (n, nr) not in cuts]
    return list(found.values())


def _vjp_root(out, grad):
    """A scalar whose backward sends exactly `grad` into `out` (d<out, grad>/d out = grad).

    Same numbers as out.backward(grad); that call imports sympy on first use, ~3 s in every
    fresh rank on a busy 2-core laptop, longer than the whole pipeline step.
    """
    return out if grad is None else (out * grad).sum()
