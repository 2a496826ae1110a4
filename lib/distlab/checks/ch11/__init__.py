"""Checkers for workbook 11: each exercise fixes, or detects, one class of distributed bug.

Every checker runs the learner's code on real ranks at two or more world sizes or mesh shapes
(odd ones too) and proves it gives what one process gives, reads the run's trace to see that the
right ranks talked and that what travelled is what the answer needs, and refuses the course's own
detectors and loops (`distlab.debug`), the checkers' helpers and torch's object collectives (as
chapter 02's checkers do). A hang is caught by a short timeout and reported as one sentence naming
where the ranks were. Sizes and values a constant could match are drawn afresh at every check.

One module per exercise, over what they share (`_common`: what is refused, the launch):
- `loss_report`:       1. logging without a hang: the mean loss and the worst rank;
- `accumulation`:      2. gradient accumulation whose last micro-batch is short;
- `sync_state`:        3. replicas that never were equal: parameters and buffers;
- `divergence`:        4. which rank's gradients differ, at which step, in which parameter;
- `pipeline`:          5. a pipeline on a (dp, pp) mesh: forward and backward;
- `sequence_parallel`: 6. sequence parallel's LayerNorm gradients, on a dp x tp mesh.
"""
from ._common import TIMEOUT, WORLD_SIZES  # noqa: F401
from .accumulation import (ACC_CASES, ACC_MICRO, ACC_STEPS, _acc_sizes,  # noqa: F401
                           check_accumulation)
from .divergence import DIVERGENCE_CASES, check_first_divergence  # noqa: F401
from .loss_report import REPORT_CASES, _expected_report, check_loss_report  # noqa: F401
from .pipeline import (PIPE_ROWS, PIPE_SHAPES, PIPE_WIDTH, _pipe_expected,  # noqa: F401
                       _pipe_input, _pipe_stage, check_pipeline_step)
from .sequence_parallel import (SP_CASES, SP_DIMS, _seeded_block,  # noqa: F401
                                check_sequence_parallel_grads)
from .sync_state import check_sync_state  # noqa: F401
