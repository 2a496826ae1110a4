"""Exercise checkers: run the learner's function for real, compare with the reference, and say in
one sentence what differs (which rank, which element, expected vs got) or that it passed.

Each chapter's checkers live in `distlab.checks.chNN`; this package's private modules hold what
they share, one module per idea, and every name is re-exported here (`from . import compare`):
- `_verdict`: a check's one sentence — CheckFailed, passed, first_difference, compare;
- `_learner`: calling and running the learner's function (a stub named before any rank starts,
  a refusal or a deadlock turned into that sentence);
- `_hangs`: where the ranks of a hung run wait, and what to change;
- `_forbid`: refusing the course's own answers while the learner's function runs;
- `_traffic`: the one traffic rule of every checker that judges communication — what travelled,
  how many bytes, on which group, for collectives and messages alike.
"""
from ..launch import RankFailed, RunTimeout  # noqa: F401
from ._forbid import _refusing_code, forbid  # noqa: F401
from ._hangs import hang_advice, where_ranks_wait  # noqa: F401
from ._learner import (_not_written, call_learner, expect_arguments, learner_seconds,  # noqa: F401
                       run, run_learner, unsolved_stub)
from ._verdict import (CheckFailed, UsedCourseCode, compare, first_difference,  # noqa: F401
                       passed, sizes_phrase)
