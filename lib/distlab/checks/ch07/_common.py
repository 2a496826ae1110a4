"""What workbook 07's checks share: the refused course code, the launch, comparing a result."""
import re

import torch

from ... import tensor_parallel as _tpm
from ... import tp_comm as _tp_comm
from ... import vocab_parallel as _vp
from ...launch import RankFailed
from .. import CheckFailed, UsedCourseCode, _not_written, compare, run


TOL = dict(atol=1e-9, rtol=1e-9)
TIMEOUT = 30  # a learner's deadlock is reported (with where each rank waits) within this


def _course_code():
    """What the workbook asks the learner to write: the course's versions are refused."""
    objs = [_tp_comm._all_reduce, _tp_comm._all_gather, _tp_comm._reduce_scatter,
            _tp_comm._split, _tp_comm.all_gather_fwd_reduce_scatter_bwd,
            _tp_comm.reduce_scatter_fwd_all_gather_bwd, _tp_comm.all_gather_fwd_split_bwd,
            _tp_comm.split_fwd_all_gather_bwd, _tp_comm.identity_fwd_all_reduce_bwd,
            _tp_comm.all_reduce_fwd_identity_bwd, _tpm.replicated, _tpm.ColumnParallelLinear,
            _tpm.RowParallelLinear, _tpm.ParallelMLP, _tpm.ParallelBlock]
    for cls in (_tp_comm.AllGatherFwdReduceScatterBwd, _tp_comm.ReduceScatterFwdAllGatherBwd,
                _tp_comm.AllGatherFwdSplitBwd, _tp_comm.SplitFwdAllGatherBwd,
                _tp_comm.IdentityFwdAllReduceBwd, _tp_comm.AllReduceFwdIdentityBwd,
                _vp._VocabParallelCrossEntropy):
        objs += [cls.forward, cls.backward]
    # chapter 07 names the vocab-parallel module (its loss is exercise 2's answer)
    return objs + [_vp.vocab_parallel_cross_entropy, _vp.VocabParallelEmbedding.forward,
                   _vp.ParallelLMHead.forward]


def _ints(shape, seed, low=-3, high=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).double()


def _run(rank_fn, ws, *args, name, is_function=False, **kw):
    """Run traced; the course's own code refused with its one sentence; a stub named (the
    Function whose forward or backward is still a stub, when that is where it raised); a
    backward that returns the wrong shape told so."""
    try:
        return run(rank_fn, ws, *args, timeout=TIMEOUT, trace=True, **kw)
    except RankFailed as e:
        said = (str(e.exception or e).splitlines() or [""])[-1]
        if e.exc_type == "NotImplementedError":
            frames = re.findall(r"line \d+, in (\w+)", e.remote_traceback or "")
            if not is_function and frames and frames[-1] in ("forward", "backward"):
                raise _not_written(f"the {frames[-1]} of the autograd Function that {name} "
                                   f"uses") from None
            raise _not_written(name) from None
        if e.exc_type in (UsedCourseCode.__name__, CheckFailed.__name__):
            raise CheckFailed(said) from None
        text = str(e.exception or e)
        if e.exc_type is None or "distributed_c10d.py" in (e.remote_traceback or ""):
            # gloo's own words (sizes that differ, "Connection closed by peer") name no cause a
            # learner can act on; in these checks it is a collective the ranks of a group did
            # not all call alike — most often one that ran over the whole world
            raise CheckFailed(
                f"a collective in {name} failed on rank {e.rank} ({_first_line(text)}): the ranks "
                f"of a group must call the same collectives with tensors of the same size, on the "
                f"group they were given — pass group=group to every collective and size every "
                f"buffer with dist.get_world_size(group), never the whole world's.") from None
        if e.exc_type == "RuntimeError" and "returned an invalid gradient" in text:
            found = re.search(r"Function (\w+?)Backward returned an invalid gradient at index "
                              r"(\d+) - got \[([\d, ]*)\] but expected shape compatible with "
                              r"\[([\d, ]*)\]", text)
            if found:
                fn, _, got, want = found.groups()
                raise CheckFailed(
                    f"{fn}.backward returned a gradient of shape ({got}) for an input of shape "
                    f"({want}): backward returns the gradient of forward's input, shaped like "
                    f"that input (here: the other collective of the pair).") from None
        raise


def _first_line(text):
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "no message")
    return line if len(line) <= 120 else line[:117] + "..."


def _returned_tensor(out, like, what, hint=""):
    """Inside a rank, before anything else happens: the learner's result has the right shape."""
    if not isinstance(out, torch.Tensor):
        raise CheckFailed(f"{what} should return a tensor; it returned {type(out).__name__}.")
    if tuple(out.shape) != tuple(like):
        raise CheckFailed(f"{what} returned shape {tuple(out.shape)}; expected {tuple(like)}"
                          f"{hint}.")
    if not out.requires_grad:
        raise CheckFailed(f"{what} returned a tensor autograd cannot differentiate (no grad_fn): "
                          f"no .detach(), no .data, no copy into a new tensor — return the "
                          f"result of your Function's apply or of torch operations.")
    return out


def _scaled(got, expected, ws):
    return (got is not None and expected.abs().max() > 0
            and torch.allclose(got, ws * expected, **TOL))


def _compare(got, expected, where, hint=lambda got, exp: ""):
    for what in expected:
        if got[what] is None:
            raise CheckFailed(f"{where}, {what}: none came back; is the output still connected "
                              f"to autograd (no .detach(), no copy into a new tensor)?")
        try:
            compare(got[what], expected[what], f"{where}, {what}", **TOL)
        except CheckFailed as e:
            raise CheckFailed(str(e)[:-1] + hint(what, got[what]) + ".") from None
