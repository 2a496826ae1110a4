"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resumable under another layout.

    save(folder, step, stage, mesh, optimizer, meta)     # collective: every rank writes its part
    step, meta = load(folder, stage, mesh, optimizer, dense_model)   # collective: each rank reads its part
    everything = read(folder)                             # one process, no process group (tests, notebooks)

Two formats, both under the DENSE names of the one-process model, so that the files do not
depend on the (dp, pp, tp) layout that wrote them:

- sharded (the default, what torchtitan does): each rank offers only ITS shards, as DTensors on
  the stage's (dp, tp) DeviceMesh — Shard(0) for a column-parallel weight, Shard(1) for a
  row-parallel one, Replicate() for the small replicated tensors and along dp. A DTensor knows
  its global shape and where its shard sits in it, so DCP writes each shard once (the dp replicas
  offer the same chunk; the planner DEDUPLICATES it) and, on load into DTensors of ANOTHER layout,
  each rank reads only the saved chunks that overlap its new shard: that is resharding. Stacked
  matrices (chapter 07's qkv: each rank holds its slice of q, of k and of v) are saved as their
  pieces, "<name>.q", ".k", ".v", each an ordinary row shard;
- dense (`sharded=False`, the simple alternative): each rank all-gathers its tp shards first, so
  every rank holds its WHOLE stage — at 70B on tp8 x pp8 that is ≈ 100 GB of fp32 per rank at
  every save (`save_costs` computes it) — and on load each rank reads whole tensors and keeps its
  slice: tp times the bytes it needs.

Keys: "model.<name>" (every parameter), "optim.<name>.exp_avg" / ".exp_avg_sq" and "optim.step"
(Adam's state), "rng.<rank>" (every rank's CPU random generator; "rng.<rank>.cuda" its GPU's, where
there is one), "meta" (step, losses, data
position, the model's configuration), and in the sharded format "layout" (the dp, pp, tp that
wrote it).

Each save goes to a folder NO save has used before: <folder>/step-<n>, or step-<n>.1, .2, ...
after the saves of step n before it (a re-run saving the step `latest` already points at must
not rewrite the files of the only good checkpoint in place). Only when every rank has finished
writing does rank 0 point <folder>/latest at it (write a small file, then atomic rename), and
only then are the step folders OLDER than it removed: a newer one may still be being written.
A run killed in the middle of a save resumes from the previous checkpoint, never from half of
one; latest never moves back to an older step (such a save is refused in a sentence).
`save(..., background=True)` returns as soon as the state is staged (copied) and writes it with
dcp.async_save in a thread; its `wait()` is where `latest` switches. One save at a time: the
next save() finishes a pending one first, so two saves never run their collectives at once.
"""
# One module per idea; the names below keep `distlab.checkpoint.<name>` working.
from .folder import BrokenCheckpoint, damage, latest, _commit, _fresh_name, _reader
from .pieces import _pieces, _sharded, _state
from .writing import Pending, save
from .reading import consolidate, load, mismatch, read, read_meta
from .costs import (LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_INTERRUPTIONS, lost_fraction, mtbf_seconds,
                    save_costs, young_daly)
from .resharding import reshard_problem
# `stateful` (torch's get_state_dict and Stateful) is imported where it is used: it pulls in FSDP's
# state-dict machinery, which distlab.train's torchrun workers do not need.
