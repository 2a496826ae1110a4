"""Checkers for workbook 10: putting tp shards back together, the loss every rank reports, and
one training step on a dp x pp x tp mesh built by hand.

One module per exercise: `unshard` (1. a dense weight from its column-parallel shards),
`token_loss` (2. the loss over every real token), `step_3d` (3. one training step on a mesh you
build, judged by the values that travelled: `_carried`), `layout_choice` (4. choosing the layout
for a model and a cluster).
"""
from .layout_choice import LAYOUT_CASES, check_choose_layout  # noqa: F401
from .reshard import RESHARD_CASES, check_read_plan  # noqa: F401
from .step_3d import STEP_BATCH, STEP_CFG, STEP_LR, STEP_MESHES, check_step_3d  # noqa: F401
from .token_loss import (LOSS_MESHES, _micro_batches, _token_means,  # noqa: F401
                         check_token_mean_loss)
from .unshard import _reference_unshard, check_unshard_column  # noqa: F401
