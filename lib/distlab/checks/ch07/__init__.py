"""Checkers for workbook 07: what the chapter describes but never displays.

1. `check_sequence_parallel_pair`: the two autograd Functions of sequence parallelism — all-gather
   along the sequence in forward / reduce-scatter in backward (entering a TP region) and its
   mirror (leaving one) — each run in a column- or row-parallel layer and both in a residual MLP,
   compared in float64 with the dense layer: outputs, the input's gradient, every weight shard's
   gradient. They run on real SUBGROUPS (`LAYOUTS`: 4 ranks as two groups of 2, 5 ranks as
   groups [1, 3] and [0, 2, 4]), each group on numbers of its own, so a Function that talks to
   the whole world is refused. From the run's trace, one traffic rule (`_check_traffic`): every
   collective and message on the group the Function was given, and each rank sending, in each
   phase, (N−1)/N of the sequence — what a ring all-gather or reduce-scatter sends: nothing sent
   where a sum over ranks must travel (a gradient kept locally) is refused, twice that (an
   all-reduce and a slice) too; one collective or a hand-written ring of send/recv are alike.
   What each Function saves for backward is measured: no more than this rank's own tokens.
   torch's differentiable collectives (`torch.distributed.nn.functional`, the autograd
   functional collectives) are refused: their backward is the exercise.
2. `check_vocab_parallel_cross_entropy`: each rank holds a vocabulary shard of the logits
   (uneven shards included); the per-token loss and the logit shard's gradient must equal dense
   `F.cross_entropy` in float64, with logits near 1000 (float64's exp overflows above 709: a
   missing max subtraction gives inf). On the same subgroups as 1. From the trace: what travels
   in forward is a few numbers per token on the group given, never a vocabulary's worth (an
   all-gather of the logits followed by a dense loss gives the right numbers: refused, with
   why), and the backward sends nothing.
3. `check_tp_comm_estimate` (predict, then run): the learner's formula for one transformer
   layer's TP communication (forward + backward; with or without sequence parallelism) on a
   calibrated preset, compared term by term (latency alone, bandwidth alone, each dtype) with the
   closed form the emulator charges, which names the term that is off; then with the course's
   ParallelBlock run emulated on meta tensors at real size, inside a node and across two.

Inputs are small integers wherever the numbers may reach a message, so they can be read by eye.

One module per exercise (`sequence_parallel`, `vocab_loss`, `comm_estimate`) over what they
share: `_common` (the refused course code, the launch, comparing a result), `_groups` (real
subgroups and the traffic rule) and `_functions` (judging an autograd Function the learner wrote).
"""
from ._common import TIMEOUT, TOL  # noqa: F401
from ._groups import LAYOUTS  # noqa: F401
from .comm_estimate import (ESTIMATE_CASES, OPS, RUN_SHAPE, RUN_TP, TPLink,  # noqa: F401
                            _emulated_layers, _reference_layer_seconds, check_tp_comm_estimate,
                            tp_link)
from .sequence_parallel import (LR, SP_BATCH, SP_LAYOUTS, SP_PER, SP_STEPS,  # noqa: F401
                                SP_WIDTH, _check_traffic, check_sequence_parallel_pair)
from .vocab_loss import (PER_TOKEN, VOCAB_CASES, VOCAB_LAYOUTS,  # noqa: F401
                         check_vocab_parallel_cross_entropy)
