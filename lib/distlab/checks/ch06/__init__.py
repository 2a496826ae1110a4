"""Checkers for workbook 06: a ZeRO-2 step over one flat buffer on a process group, a ZeRO-3
layer's forward and backward, and the peak of ZeRO-3 without resharding after forward.

The first two judge the result (against one process, float64 with tight tolerances) AND what the
ranks sent: ZeRO's point is to shard memory at DDP's communication cost, so an answer that gets
the numbers right by moving more bytes is refused, with the bytes it moved (from the run's
trace), and so is a collective on another group than the one given; what each collective carried
is read inside the rank, so a decoy collective of zeros beside the real exchange is named. The
third compares the learner's peak, and the moment they place it at, with a walk of the step's
moments on cases whose peaks fall at different moments.
"""
from ._common import SIZES, STEPS, BATCH, LR, TIMEOUT  # noqa: F401
from .flat_step import FLAT_GROUPS, check_flat_zero_step  # noqa: F401
from .no_reshard import NO_RESHARD_CASES, _no_reshard_moments, check_no_reshard_peak  # noqa: F401
from .zero3_layer import LAYERS, check_zero3_layer  # noqa: F401
