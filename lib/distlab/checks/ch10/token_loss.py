"""Workbook 10, exercise 2: the loss over every real token, micro-batches of unequal length."""
import torch

from ... import parallel3d as p3
from .. import CheckFailed, forbid, passed, sizes_phrase
from ..ch01 import learner_run


# (dp, pp, tp): tp copies of the loss on the last stage (dp != tp); an odd dp (a sum is not a
# mean, the replicas weigh by their tokens); a middle stage (the value comes from the LAST one),
# with fewer micro-batches than stages (m = 2 < p = 3), so no count of micro-batches is built in.
LOSS_MESHES = ((1, 2, 2), (3, 1, 1), (1, 3, 1))


def _n_micro(pp):
    return 2 if pp >= 3 else 3


def _micro_batches(rank, d, last, m=3):
    """(losses, tokens) a rank holds, m micro-batches: on the last stage, each micro-batch's mean
    loss over its real tokens and how many real tokens it had (padding makes them unequal,
    between micro-batches and between replicas); elsewhere numbers that are not losses, which
    must not count."""
    if not last:
        return (torch.tensor([50.0 + rank, 60.0, 70.0], dtype=torch.float64)[:m],
                torch.tensor([7, 1 + rank, 3])[:m])
    losses = torch.tensor([2.0 + 0.5 * d, 3.25 - 0.25 * d, 1.5 + 0.125 * d], dtype=torch.float64)
    tokens = torch.tensor([[5, 16, 9], [12, 3, 16], [1, 8, 2]][d % 3])
    return losses[:m], tokens[:m]


def _token_means(dp, m=3):
    """The right answer and the answers of three wrong rules, by what they compute."""
    rows = [_micro_batches(0, d, True, m) for d in range(dp)]
    weighted = sum(float((l * n).sum()) for l, n in rows)
    count = sum(int(n.sum()) for _, n in rows)
    replica_means = [float((l * n).sum()) / int(n.sum()) for l, n in rows]
    return {"right": weighted / count,
            "the mean of the micro-batches' means (every micro-batch weighs the same, the "
            "chapter's rule for equal micro-batches)": sum(float(l.mean()) for l, _ in rows) / dp,
            "the mean of the replicas' token means (every replica weighs the same, however many "
            "real tokens it had)": sum(replica_means) / dp,
            "the sum of the replicas' token means": sum(replica_means)}


def _token_loss_on_mesh(rank, world_size, dp, pp, tp, fn):
    mesh = p3.Mesh3D(dp, pp, tp)
    losses, tokens = _micro_batches(rank, mesh.d, mesh.p == pp - 1, _n_micro(pp))
    before = (losses.clone(), tokens.clone())
    with forbid(p3.global_loss, p3.train_step, _micro_batches, _token_means,
                exercise="send the sums along the pp and dp groups yourself"):
        got = fn(losses, tokens, mesh)
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    # The caller still needs its own numbers after logging the loss (its own statistics).
    changed = not (torch.equal(losses, before[0]) and torch.equal(tokens, before[1]))
    return got, changed


def check_token_mean_loss(fn, meshes=LOSS_MESHES):
    """fn(losses, tokens, mesh) on every rank -> the mean loss over every real token of the global
    batch, as a float, on every rank."""
    name = getattr(fn, "__name__", "token_mean_loss")
    for dp, pp, tp in meshes:
        where = f"{name} on dp={dp} x pp={pp} x tp={tp} ({_n_micro(pp)} micro-batches)"
        means = _token_means(dp, _n_micro(pp))
        try:
            got = learner_run(_token_loss_on_mesh, dp * pp * tp, dp, pp, tp, fn, name=name,
                              timeout=60, hang_rule="every rank must call the same collectives "
                              "on its pp group and then its dp group, the other stages too.")
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as e:  # a crash inside the learner's code: say where, in one line
            raise CheckFailed(f"{where} failed: {str(e).splitlines()[0]}") from None
        for rank, (value, changed) in enumerate(got):
            if not isinstance(value, float):
                raise CheckFailed(f"{where}: rank {rank} returned {type(value).__name__}; return "
                                  f"the loss as a Python float (loss.item()).")
            if abs(value - means["right"]) > 1e-12 * max(1.0, abs(means["right"])):
                rule = next((label for label, v in means.items()
                             if label != "right" and abs(value - v) < 1e-12), None)
                why = (f": that is {rule}; a real token weighs the same wherever it sits, so add "
                       f"up loss × tokens and the tokens over every micro-batch and replica, "
                       f"then divide once" if rule else
                       " — only the last stage's numbers are losses (the other stages' must "
                       "not count), and the mean is over every replica's real tokens")
                raise CheckFailed(f"{where}: rank {rank} returned {value:.6g}, expected "
                                  f"{means['right']:.6g}{why}.")
            if changed:
                raise CheckFailed(f"{where} returned the right value, but changed rank {rank}'s "
                                  f"losses or tokens in place; the caller still needs them: "
                                  f"reduce new tensors.")
    passed(f"{name} gives every rank the mean over every real token of the global batch on "
           f"meshes {sizes_phrase(['x'.join(map(str, s)) for s in meshes])}, micro-batches and "
           f"replicas of unequal token counts, fewer micro-batches than stages on 1x3x1.")
