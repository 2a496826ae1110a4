"""Checkers of workbook 12: the online softmax in the form a flash kernel streams it (a running
maximum, a running sum and an unnormalised output), one ring hop, ring attention in the other
direction (the queries travel, K and V stay), ring attention's backward (the chapter shows the
course's, not this one), a prediction: one ring step's kernel and hop, and the block length
where the hop hides — and per-document zig-zag, the placement that balances a ring over packed
documents (chapter 12b's section 3 describes it without showing its code).

The online softmax is checked in this process on blocks of keys folded one by one, two
sequences interleaved (a fold that remembers more than its state cannot pass), with rows whose
maximum arrives in the last block, rows that see no key at all or none in the first blocks, and
scores of about a thousand (exp overflows float64 above 709). The ring hop, the pass-Q ring and
the backward run on real ranks at world sizes 3 and 5, where left and right neighbours differ;
the run's trace must show point-to-point messages to the right neighbour only, judged by the
bytes they carry (one packed message per hop is as good as one per tensor): a hop carries
exactly its tensors; the pass-Q ring at least the queries' N − 1 hops and the output's way
home, under grouped-query attention where K and V are four times smaller than Q, so that a ring
that passes K and V instead is refused although its numbers are right.

The prediction (`check_ring_step`) is compared term by term (the kernel; the hop's bandwidth
term with α = 0; its latency with infinite bandwidth) with the closed form, then with the
course's ring attention run at full size on meta tensors under the emulator, on a device and
two links built here (NVLink-like and InfiniBand-like), below and above the learner's crossover.

The per-document placement (`check_per_document_zigzag`) is asked for every rank here, must
cover every token once, then runs through the course's `document_ring_attention` on 1 to 4
ranks: each rank's output against one process's masked attention, each rank's logged work
against the others', and last the chunks each rank holds.

One module per exercise (`online_softmax`, `hop`, `pass_q`, `backward`, `step_prediction`,
`per_document`) over what they share (`_common`: the world sizes, the course's code refused, the
ring's traffic rule).
"""
from ._common import COURSE, LARGE, WORLD_SIZES  # noqa: F401
from .backward import check_ring_backward  # noqa: F401
from .hop import check_ring_hop  # noqa: F401
from .online_softmax import check_online_softmax  # noqa: F401
from .pass_q import (HEAD_DIM, HEADS, KV_HEADS, PER_RANK, _gqa_dense, _gqa_inputs,  # noqa: F401
                     check_ring_attention_pass_q)
from .per_document import check_per_document_zigzag  # noqa: F401
from .step_prediction import (BLOCKS, FLOPS, IB, NVLINK, RANKS, STEP_CASES,  # noqa: F401
                              _emulated_ring, check_ring_step)
