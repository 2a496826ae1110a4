"""Collectives built from nothing but point-to-point messages (send/recv, isend/irecv).

    ring_all_reduce(t)            every rank ends with the reduction of all ranks' t (in place)
    ring_reduce_scatter(t)        rank r ends with chunk r of that reduction
    ring_all_gather(t)            every rank ends with the list of all ranks' t
    tree_broadcast(t, src)        every rank ends with src's t, in ceil(log2 N) rounds
    all_to_all(outs, ins)         rank r sends ins[j] to rank j and receives outs[j] from rank j
    naive_all_reduce(t)           reduce to one root, then send back: the baseline the ring beats

Every function takes an explicit `group` (None: the default group) and speaks in ranks of that
group. They work for any world size >= 1 and any number of elements: a tensor is cut into N
chunks the way `torch.tensor_split` cuts it, so chunks differ by at most one element and some
are empty when the tensor has fewer elements than there are ranks.

The ring all-reduce is a ring reduce-scatter followed by a ring all-gather. In each of the
2(N-1) steps a rank sends one chunk (1/N of the tensor) to its right neighbour and receives one
from its left, so every rank sends 2(N-1)/N of the tensor in total, however large N is.
"""
import operator

import torch
import torch.distributed as dist

_COMBINE = {
    "sum": torch.add,
    "mean": torch.add,          # summed on the ring, divided by N once at the end
    "max": torch.maximum,
    "min": torch.minimum,
}
_FROM_REDUCE_OP = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean",
                   dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


# ---- the arithmetic of the ring (shared with the pictures in distlab.viz.ring) -----------------

def chunk_bounds(length, world_size):
    """[(start, stop)] of the N chunks of `length` elements, as torch.tensor_split cuts them."""
    base, extra = divmod(length, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reduce_scatter_step(rank, step, world_size):
    """(chunk this rank sends right, chunk it receives from the left) at reduce-scatter `step`.

    Chunk c starts its trip at rank c+1 and picks up one rank's contribution per step, so after
    N-1 steps it arrives, complete, at rank c: rank r owns chunk r, as torch's reduce_scatter has it.
    """
    return (rank - step - 1) % world_size, (rank - step - 2) % world_size


def all_gather_step(rank, step, world_size):
    """(chunk this rank sends right, chunk it receives from the left) at all-gather `step`.

    Rank r starts with chunk r and forwards whatever arrived in the step before.
    """
    return (rank - step) % world_size, (rank - step - 1) % world_size


# ---- helpers ------------------------------------------------------------------------------------

def _rank_and_size(group):
    if not dist.is_initialized():
        raise ValueError("these collectives run on ranks with a process group: call them "
                           "inside a function started by distlab.run (or after "
                           "dist.init_process_group).")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the process group it was given.")
    return rank, dist.get_world_size(group)


def _check_rank(name, value, n):
    """A root/src argument must name a rank of the group: torch would crash sending elsewhere."""
    try:
        rank = operator.index(value)      # int and numpy integers, but not 1.0 or "0"
    except TypeError:
        rank = None
    if rank is None or isinstance(value, bool) or not 0 <= rank < n:
        raise ValueError(f"{name} must be a rank of the group, 0 to {n - 1}; got {value!r}.")
    return rank


def _check_tensor(name, value):
    """A collective carries torch tensors; anything else would fail deep inside torch."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got one of type {type(value).__name__}. "
                        f"Convert it first, e.g. torch.as_tensor(x).")
    return value


def _contiguous(tensor):
    """`tensor` itself if its elements are laid out in order, else a contiguous copy of it.

    Messages travel from one flat block of memory, and the chunks of a flat view of a strided
    tensor (a matrix column, a transposed matrix) are not such blocks. A collective works on the
    copy and `_write_back` puts the result into the caller's tensor.
    """
    _check_tensor("tensor", tensor)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _write_back(buf, tensor):
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def _op_name(op):
    name = _FROM_REDUCE_OP.get(op, op) if isinstance(op, (str, dist.ReduceOp)) else op
    if not isinstance(name, str) or name not in _COMBINE:
        raise ValueError(f"op must be one of {sorted(_COMBINE)} (or the matching dist.ReduceOp); "
                         f"got {op!r}.")
    return name


def _check_mean(tensor, op):
    _check_tensor("tensor", tensor)
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='mean' needs a floating-point tensor, but got {tensor.dtype}: "
                        f"the average of whole numbers is generally not a whole number.")


def _exchange(send_buf, dst, recv_buf, src, group):
    """Send to one neighbour and receive from another at the same time.

    Posting both before waiting is what keeps a ring from deadlocking: if every rank first sent
    and only then received, each would wait for its neighbour to start receiving. The two are
    submitted together with batch_isend_irecv, which on NCCL groups them into one launch (two
    separate isend/irecv to the same peer can deadlock there at world size 2); on gloo it is the
    same as calling isend and irecv. Empty chunks travel no message: both ends know the sizes.
    """
    ops = []
    if send_buf.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send_buf, group=group, group_peer=dst))
    if recv_buf.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv_buf, group=group, group_peer=src))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _ring_reduce_scatter_(flat, bounds, op, group):
    """In place on a flat buffer: afterwards chunk `rank` of `flat` holds the reduction."""
    rank, n = _rank_and_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    combine = _COMBINE[op]
    incoming = torch.empty(max(stop - start for start, stop in bounds), dtype=flat.dtype,
                           device=flat.device)
    for step in range(n - 1):
        send_c, recv_c = reduce_scatter_step(rank, step, n)
        (s0, s1), (r0, r1) = bounds[send_c], bounds[recv_c]
        buf = incoming[:r1 - r0]
        _exchange(flat[s0:s1], right, buf, left, group)
        combine(flat[r0:r1], buf, out=flat[r0:r1])


def _ring_all_gather_(flat, bounds, group):
    """In place on a flat buffer whose chunk `rank` is filled: afterwards every chunk is."""
    rank, n = _rank_and_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = all_gather_step(rank, step, n)
        (s0, s1), (r0, r1) = bounds[send_c], bounds[recv_c]
        # Sending chunk a and receiving chunk b != a into the same buffer never overlap.
        _exchange(flat[s0:s1], right, flat[r0:r1], left, group)


def _check_all_to_all(output_list, input_list, rank, n):
    """One tensor per rank each way; this rank's own pair must match, since copy_ would
    broadcast a smaller input or convert a dtype without a word."""
    for name, tensors in (("input_list", input_list), ("output_list", output_list)):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"all_to_all takes {name} as a list of tensors, one per rank; got a "
                            f"{type(tensors).__name__}.")
        for t in tensors:
            _check_tensor(f"every element of {name}", t)
    if len(input_list) != n or len(output_list) != n:
        raise ValueError(f"all_to_all needs one input and one output tensor per rank ({n}); got "
                         f"{len(input_list)} inputs and {len(output_list)} outputs.")
    mine, into = input_list[rank], output_list[rank]
    if mine.shape != into.shape or mine.dtype != into.dtype:
        raise ValueError(f"rank {rank} keeps input_list[{rank}] in output_list[{rank}], so they "
                         f"must have the same shape and dtype; got {tuple(mine.shape)} {mine.dtype} "
                         f"and {tuple(into.shape)} {into.dtype}.")


# ---- the collectives ----------------------------------------------------------------------------

def ring_all_reduce(tensor, op="sum", group=None):
    """Reduce `tensor` over the ranks of `group`, in place, like dist.all_reduce; returns it.

    op: "sum", "mean", "max" or "min" (or dist.ReduceOp.SUM / AVG / MAX / MIN).
    """
    op = _op_name(op)
    _check_mean(tensor, op)
    rank, n = _rank_and_size(group)
    buf = _contiguous(tensor)
    flat = buf.view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    _ring_reduce_scatter_(flat, bounds, op, group)
    if op == "mean":
        start, stop = bounds[rank]
        flat[start:stop] /= n        # once, on the chunk this rank owns, before it is shared
    _ring_all_gather_(flat, bounds, group)
    return _write_back(buf, tensor)


def ring_reduce_scatter(tensor, op="sum", group=None):
    """Chunk `rank` (torch.tensor_split of the flattened tensor into N) of the reduction over ranks.

    `tensor` is left unchanged, like the inputs of dist.reduce_scatter.
    """
    op = _op_name(op)
    _check_mean(tensor, op)
    rank, n = _rank_and_size(group)
    flat = tensor.reshape(-1).clone(memory_format=torch.contiguous_format)
    bounds = chunk_bounds(flat.numel(), n)
    _ring_reduce_scatter_(flat, bounds, op, group)
    start, stop = bounds[rank]
    out = flat[start:stop].clone()
    if op == "mean":
        out /= n
    return out


def ring_all_gather(tensor, group=None):
    """The list of every rank's `tensor` (same shape on all ranks), in rank order, like dist.all_gather."""
    rank, n = _rank_and_size(group)
    size = _check_tensor("tensor", tensor).numel()
    flat = torch.empty(n * size, dtype=tensor.dtype, device=tensor.device)
    flat[rank * size:(rank + 1) * size] = tensor.reshape(-1)
    _ring_all_gather_(flat, [(i * size, (i + 1) * size) for i in range(n)], group)
    return list(flat.view(n, *tensor.shape).unbind(0))


def tree_broadcast(tensor, src=0, group=None):
    """Copy rank `src`'s tensor to every rank, in place, along a binomial tree; returns it.

    Count ranks relative to src (v = rank - src mod N). In round k the 2^k ranks that already
    hold the data (v < 2^k) each send it to v + 2^k, so the number of holders doubles every
    round and ceil(log2 N) rounds reach everyone, where a root sending to each rank in turn
    would need N - 1.
    """
    rank, n = _rank_and_size(group)
    src = _check_rank("src", src, n)
    buf = _contiguous(tensor)
    v = (rank - src) % n
    mask = 1
    while mask < n and buf.numel() > 0:   # an empty tensor needs no message
        if v < mask and v + mask < n:
            dist.send(buf, group=group, group_dst=(v + mask + src) % n)
        elif mask <= v < 2 * mask:
            dist.recv(buf, group=group, group_src=(v - mask + src) % n)
        mask *= 2
    return _write_back(buf, tensor)


def all_to_all(output_list, input_list, group=None):
    """Rank r sends input_list[j] to rank j and receives output_list[j] from rank j, like dist.all_to_all.

    Sizes may differ between pairs (each receiver gives the shapes it expects). In step s every
    rank sends to rank + s and receives from rank - s, so each step is a permutation: no rank
    receives two messages at once.
    """
    rank, n = _rank_and_size(group)
    _check_all_to_all(output_list, input_list, rank, n)
    output_list[rank].copy_(input_list[rank])
    for step in range(1, n):
        dst, src = (rank + step) % n, (rank - step) % n
        out = output_list[src]
        buf = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        _exchange(input_list[dst].contiguous(), dst, buf, src, group)
        _write_back(buf, out)
    return output_list


def naive_all_reduce(tensor, op="sum", group=None, root=0):
    """All-reduce the obvious way: everyone sends to `root`, root reduces and sends the result back.

    Correct, and the baseline of the cost model: root receives N-1 whole tensors and sends N-1,
    one after another, so its time grows linearly with N where the ring's stays nearly flat.
    """
    op = _op_name(op)
    _check_mean(tensor, op)
    rank, n = _rank_and_size(group)
    root = _check_rank("root", root, n)
    buf = _contiguous(tensor)
    if buf.numel() == 0:                 # nothing to reduce, and no message to send
        return tensor
    if rank == root:
        incoming = torch.empty_like(buf)
        for other in range(n):
            if other != root:
                dist.recv(incoming, group=group, group_src=other)
                _COMBINE[op](buf, incoming, out=buf)
        if op == "mean":
            buf /= n
        for other in range(n):
            if other != root:
                dist.send(buf, group=group, group_dst=other)
    else:
        dist.send(buf, group=group, group_dst=root)
        dist.recv(buf, group=group, group_src=root)
    return _write_back(buf, tensor)
