"""ZB's split backward: I (the input's gradient, and the gradient at every layer output that
feeds a weight), then W (each weight's gradient from those), over a retained graph."""
import torch


def _input_gradients(s):
    """I: the input's gradient, and on the way the gradient at every layer output that feeds a
    weight (what W needs): autograd skips the weight-gradient products, which nothing asked for.
    retain_graph: W reuses the graph."""
    want = ([s["inp"]] if s["inp"].requires_grad else []) + [o for _, o in s["layers"]]
    got = torch.autograd.grad(_vjp_root(s["out"], s["grad"]), want, retain_graph=True,
                              allow_unused=True) if want else []
    if s["inp"].requires_grad:
        s["inp"].grad, got = got[0], got[1:]
    s["layer_grads"] = list(got)


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
    """W: every weight's gradient from the gradient I left at its layer's output; a weight
    whose layer output was not recorded (a module that returns a tuple) from the stage's
    output instead, walking the graph again. Accumulated into .grad as autograd would."""
    params = [q for q in part.parameters() if q.requires_grad]
    done = set()
    for (module, output), grad in zip(s.get("layers", []), s.get("layer_grads", [])):
        own = [q for q in module.parameters(recurse=False) if q.requires_grad]
        if grad is None or not own:
            continue
        for q, g in zip(own, torch.autograd.grad(output, own, grad, retain_graph=True,
                                                 allow_unused=True)):
            if g is not None:
                q.grad = g if q.grad is None else q.grad + g
        done.update(id(q) for q in own)
    rest = [q for q in params if id(q) not in done]
    if rest and s["out"].requires_grad:
        grads = torch.autograd.grad(_vjp_root(s["out"], s["grad"]), rest, allow_unused=True)
        for q, g in zip(rest, grads):
            if g is not None:
                q.grad = g if q.grad is None else q.grad + g


def _vjp_root(out, grad):
    """A scalar whose backward sends exactly `grad` into `out` (d<out, grad>/d out = grad).

    Same numbers as out.backward(grad); that call imports sympy on first use, ~3 s in every
    fresh rank on a busy 2-core laptop, longer than the whole pipeline step.
    """
    return out if grad is None else (out * grad).sum()
