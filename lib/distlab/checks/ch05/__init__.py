"""Checkers for workbook 05, one file per exercise's judge:

- `uneven`:    1. gradients averaged over shards of different sizes, in one all-reduce;
- `arrival`:   2. buckets rebuilt after the first step in the order the gradients arrived;
- `sampling`:  3. an epoch resumed on a different number of ranks, as DistributedSampler splits;
- `training`:  4. a scaled batch and learning rate; 5. a DDP class with no_sync;
- `script`:    6. a DDP script whose production bugs the learner finds and fixes;
- `predict`:   7. predict, then run: a real-size DDP step on N ranks from a run on one.

Each runs the learner's code on real ranks (or, for 3 and 7, calls it in this process), compares
every rank's gradients with single-process gradients on the whole batch (`_common`), and judges
what travelled by its values, not only its size (`_wire`).
"""
from ._common import GLOBAL_BATCH, STEPS  # noqa: F401
from .arrival import check_arrival_buckets  # noqa: F401
from .predict import check_step_prediction, link_terms, one_rank_step  # noqa: F401
from .sampling import RESUME_CASES, check_resume_indices  # noqa: F401
from .script import _token_reference, check_ddp_script  # noqa: F401
from .training import SCALING_CASES, check_my_ddp, check_scaled_training  # noqa: F401
from .uneven import SHARDS, check_uneven_average  # noqa: F401
