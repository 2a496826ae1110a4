"""Checkers for workbook 05, one file per exercise's judge:

- `gradients`: 1. naive gradient averaging; 2. bucketed all-reduce from autograd hooks;
- `sampling`:  3. DistributedSampler epochs and set_epoch;
- `training`:  4. a scaled batch and learning rate; 5. a DDP class with no_sync;
- `script`:    6. a DDP script whose production bugs the learner finds and fixes.

Each runs the learner's code on real ranks, each rank on its own shard of a global batch, and
compares every rank's gradients with single-process gradients on the whole batch (`_common`).
"""
from ._common import GLOBAL_BATCH, STEPS  # noqa: F401
from .gradients import check_average_gradients, check_bucketed_hooks  # noqa: F401
from .sampling import _reference_epochs, check_epoch_indices  # noqa: F401
from .script import _token_reference, check_ddp_script  # noqa: F401
from .training import SCALING_CASES, check_my_ddp, check_scaled_training  # noqa: F401
