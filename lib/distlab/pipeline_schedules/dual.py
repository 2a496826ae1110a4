"""DeepSeek's DualPipe: DualPipeV (the V placement, overlapped F&B pairs) and the
bidirectional DualPipe (the model held twice, micro-batches entering at both ends)."""
from .actions import Action, Schedule, _check


def dualpipe_v(p, m):
    """DualPipeV (DeepSeek's DualPipe "cut in half", github.com/deepseek-ai/DualPipe): the V
    placement of ZB-V, with DualPipe's eight phases per stage.

    The idea DualPipe adds is the *pair*: in the steady state each stage runs the forward of one
    micro-batch on one chunk next to the full backward of another on its other chunk
    (F0 B1, F1 B0, ...). On a GPU the two run at once and one hides the other's communication
    (DeepSeek-V3 overlaps the MoE all-to-alls of one with the compute of the other); here, and in
    `simulate`, a pair is just F then B one after the other. The cool-down splits some backwards
    into I and W to fill the drain, as zero-bubble schedules do. Needs m >= 2p. The order is
    torch.distributed.pipelining's ScheduleDualPipeV (tests compare the two), each overlapped
    pair written as its forward, then its backward.
    """
    _check(p, m)
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2p = {2 * p} micro-batches (one per virtual "
                         f"stage, so the two directions of the V both fill); got m={m}.")
    schedule, pairs = [], []
    for r in range(p):
        ops, nxt, pending, paired = [], {}, [], set()   # next mb per (chunk, kind); W's owed

        def pair():                 # the next two actions are one overlapped F&B pair
            paired.add(len(ops))

        def add(kind, c):
            key = (c, "I" if kind in "BI" else kind)
            mb = nxt.get(key, 0)
            nxt[key] = mb + 1
            ops.append(Action(kind, mb, c))
            if kind == "I":
                pending.append((mb, c))

        def owed_w():
            if pending:
                mb, c = pending.pop(0)
                ops.append(Action("W", mb, c))
        for _ in range(2 * (p - r - 1)):                    # 1: F0
            add("F", 0)
        for _ in range(r + 1):                              # 2: F0 F1
            add("F", 0)
            add("F", 1)
        for _ in range(p - r - 1):                          # 3: I1 W F1 (zero bubble)
            add("I", 1)
            owed_w()
            add("F", 1)
        for i in range(m - 2 * p + r + 1):                  # 4: F0 B1 - F1 B0 (the pairs)
            if i > 0 or r < p - 1:      # DualPipe leaves the last stage's first pair apart
                pair()
            add("F", 0)
            add("B", 1)
            pair()
            add("F", 1)
            add("B", 0)
        for _ in range(p - r - 1):                          # 5: B1 - F1 B0
            add("B", 1)
            pair()
            add("F", 1)
            add("B", 0)
        split = False
        for i in range(r + 1):                              # 6: B1 B0, then split
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            add("I" if split else "B", 1)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            add("I" if split else "B", 0)
        for _ in range(p - r - 1):                          # 7: W B0
            owed_w()
            add("I" if split else "B", 0)
        for _ in range(r + 1):                              # 8: the W's left
            owed_w()
        schedule.append(ops)
        pairs.append(paired)
    return Schedule(schedule, "v", pairs)


def dualpipe(p, m):
    """The bidirectional DualPipe (DeepSeek-V3 technical report, arXiv:2412.19437, section
    3.2.1; github.com/deepseek-ai/DualPipe): micro-batches 0 .. m/2 - 1 enter at stage 0 and run
    on chunk 0 (stage r holds piece r), micro-batches m/2 .. m - 1 enter at stage p - 1 and run on
    chunk 1 (stage r holds piece p - 1 - r). Every piece is held twice, by stages r and
    p - 1 - r, whose two gradients are summed before the optimizer step.

    Stages r and p - 1 - r run the same eight phases, mirrored: those of DualPipeV's stage
    min(r, p - 1 - r) with p/2 stages and m/2 micro-batches, where DualPipeV's chunk 0 is the
    direction that reaches the stage first (for r < p/2 chunk 0, else chunk 1). That is the
    "cut in half": fold stage p - 1 - r onto stage r and the two directions become one V.
    Needs p even and m even, m >= 2p (as DualPipe's code asserts).
    """
    _check(p, m)
    if p % 2 or m % 2 or m < 2 * p:
        raise ValueError(f"DualPipe needs an even number of stages and an even number of "
                         f"micro-batches, at least 2p = {2 * p} (half enter at each end); got "
                         f"p={p}, m={m}.")
    half = dualpipe_v(p // 2, m // 2)
    schedule = []
    for r in range(p):
        flip = int(r >= p // 2)                 # the second half meets direction 1 first
        schedule.append([Action(a.kind, a.mb + (m // 2) * (a.chunk ^ flip), a.chunk ^ flip)
                         for a in half[min(r, p - 1 - r)]])
    return Schedule(schedule, "dual", [half.pairs[min(r, p - 1 - r)] for r in range(p)])
