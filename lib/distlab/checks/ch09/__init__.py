"""Checkers for workbook 09: capacity the chapter did not write, and a dispatch with static shapes.

1. `check_prioritized_route`: top-k routing with batch-prioritized capacity (V-MoE's BPR: the
   most confident tokens are served first). Judged on this process on several shapes, including
   float32 logits of size ~100 that overflow a naive exp, then plugged into an expert-parallel
   layer on real ranks (EP 2 and 3): every rank's output and input gradient equal a one-process
   layer routed by this module's reference.
2. `check_group_capacity_keep`: the capacity counted over the whole EP group instead of per
   source rank, on real subgroups side by side (3 ranks as one group; 4 as two groups of 2; 5 as
   {0, 2} and {1, 3, 4}) with uneven token counts drawn afresh per check: every rank's keep mask
   is compared element by element with one process on its group's concatenated batch, a
   collective that reaches past the group is named from the trace, and the layer built on it
   equals one process (dropped tokens come back as zeros).
3. `check_padded_dispatch`: the dispatch with static shapes (a padded buffer of `capacity` rows
   per expert and source rank, one exchange of one shape, as XLA and CUDA graphs want): every
   rank's received buffer is compared with the rows its group's sources hold (drawn afresh, so
   only rows that travelled can match), on the same subgroups, and every rank must send the same
   bytes whatever the routing (the chapter's uneven splits, padded on arrival, are refused).

The references of these checks are written in `_references`, never shown in a notebook. The
course's own `route`, `capacity_keep`, `dispatch_plan`, `all_to_all`, the layer's group capacity,
these references and the helpers that build their data refuse to run inside the learner's
function (`forbid`, `_common`). One module per exercise: `prioritized_route`, `group_capacity`,
`padded_dispatch`.
"""
from ._common import LAYER_CASES, LAYOUTS, TIMEOUT  # noqa: F401
from ._references import D_MODEL, _group_case, _reference_route, _tokens  # noqa: F401
from .group_capacity import GROUP_CASES, check_group_capacity_keep  # noqa: F401
from .padded_dispatch import (DISPATCH_CASES, check_padded_dispatch,  # noqa: F401
                              first_difference_at)
from .prioritized_route import check_prioritized_route  # noqa: F401
