"""Pipeline schedules as plain data, and a simulator that says when each action runs.

A schedule for p stages is a list of p lists: what stage r does, in order. Each entry is an
`Action(kind, mb, chunk)`:

    F  forward of micro-batch `mb` through this stage's model chunk `chunk`
    B  its full backward (input gradient and weight gradient together)
    I  backward for the input gradient only (what the previous stage is waiting for)
    W  backward for the weight gradients only (nobody waits for it: it can fill a bubble)

With v chunks per stage (interleaved schedules) chunk c of stage r is the virtual stage
c * p + r: the model is cut into p * v pieces dealt round-robin to the stages (the "loop"
placement). ZB-V and DualPipeV place two chunks per stage in a V instead: stage r holds virtual
stages r and 2p - 1 - r, so a micro-batch goes down the stages and comes back up, and the last
stage turns it around without a message. Such a schedule is a `Schedule` (a list) whose
`placement` is "v"; every function here reads it from there. The bidirectional DualPipe places
the model twice ("dual"): the first half of the micro-batches enter at stage 0 and run on chunk
0, stage r holding piece r; the second half enter at stage p - 1 and run on chunk 1, stage r
holding piece p - 1 - r. A DualPipe schedule also names its overlapped F&B pairs
(`Schedule.pairs`), which `simulate` can run as one unit (t_fb).

`simulate` executes such lists like the real ranks do - each stage runs its list in order and
waits for the tensors it needs - but with fixed durations, and returns every action's start and
end. The same timeline drawing (distlab.viz.pipeline) is used for simulated and measured runs.

The package, one module per idea: `actions` (actions, Schedule, placements), `classic` (GPipe,
1F1B, interleaved, looped BFS), `zero_bubble` (ZB-H1, ZB-V), `dual` (DualPipeV, DualPipe),
`bubbles` (the closed forms), `simulator` (validate, simulate, bubble_fraction, peak_in_flight;
back_to_back and steady_bubble for steps with no barrier between them; parameter_gathers for a
schedule under ZeRO-3/FSDP).
"""
from .actions import (KINDS, PLACEMENTS, Action, Schedule, _check, direction, n_pieces,
                      normalize, placement_of, stage_of, virtual_stage)
from .bubbles import dualpipe_bubble, theory, theory_bubble, zb_h1_bubble, zb_v_bubble
from .classic import gpipe, interleaved_1f1b, looped_bfs, one_f_one_b
from .dual import dualpipe, dualpipe_v
from .simulator import (_messages, back_to_back, bubble_fraction, check_message_order,
                        parameter_gathers, peak_in_flight, simulate, steady_bubble, validate)
from .zero_bubble import zb_h1, zb_v

V_SCHEDULES = {"ZB-V": zb_v, "DualPipeV": dualpipe_v}


SCHEDULES = {"GPipe": gpipe, "1F1B": one_f_one_b, "interleaved 1F1B": interleaved_1f1b,
             "ZB-H1": zb_h1}


def make_schedule(name, p, m):
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}.")
    return SCHEDULES[name](p, m)
