"""Choosing a (dp, pp, tp) layout — or (dp, pp, cp, tp) with context parallelism — every candidate
priced on the calibrated hardware model (distlab.hardware) and the memory model (distlab.memory).

    rows = rank_layouts("Llama-2 13B", nodes=4, gpus_per_node=8)
    print(table(rows))

A planning model, not a simulator; measure before you believe it. bench/planner.py holds it
against the course's own 3D step run at full size on meta tensors under the emulator (they share
the device and link formulas, so that agreement checks the planner's accounting of the code's
critical path, not the hardware), and against a published configuration.

Mesh order (dp, pp, cp, tp), tp fastest: a tp group is tp neighbouring GPUs (inside one node
when tp divides a node); a cp group strides by tp, a pp group by cp·tp, a dp group by pp·cp·tp.
Each group's link is the calibrated cluster's `link_between` its ranks (NVLink inside a node;
across nodes NCCL's cross-node latency and one ring per NIC).

Time of one step (every term a function below, each pinned by tests/test_layout.py):
- compute, per micro-batch and layer on one rank: every GEMM of the layer (q/k/v with GQA's
  smaller K, V; the output projection; the MLP, SwiGLU's three matrices or GeLU's two), split
  1/tp, at the device's shape-dependent efficiency (Device.seconds with its m, n, k); causal
  flash attention, 4·b·s²·h/tp FLOPs halved by the mask (Dao 2023, FlashAttention-2 §4.1; its
  backward 2.5× the forward); the memory-bound element-wise work at HBM speed (hardware's
  68·s·b·h bytes fused, 140 unfused), split 1/tp only with sequence parallelism — without it the
  norms, residuals and dropout of Korthikanti et al.'s 10 of 34 run replicated on every tp rank.
  Backward runs each matmul's input- and weight-gradient GEMMs in their own shapes (the
  weight gradient's depth is the tokens); `recompute="full"` reruns the whole forward,
  "selective" only the attention core (free with flash attention, whose kernel recomputes it
  anyway); the LM head (vocab-parallel over tp, or whole on every tp rank) on the last stage;
  `sustained` (hardware.SUSTAINED) for what kernels lose inside a training loop;
- the pipeline bubble: (pp − 1)/(v·m) of the stage time, m micro-batches per replica and v
  model chunks per stage (`interleave`; Narayanan et al. 2021 §2.2) — the steady state runs at
  the slowest stage (the last, with the head), the fill and drain through the others;
- tensor parallel: 2 all-reduces of s·b·h per layer in forward, 2 in backward, 2 more when full
  recompute reruns the forward (6 instead of 4: the recomputed forward repeats its two;
  Korthikanti et al. 2022); with sequence
  parallelism each all-reduce is an all-gather plus a reduce-scatter of the same bytes;
  vocab-parallel embedding and head add one all-reduce each (Shoeybi et al. 2019 §3);
  `overlap_tp`: hidden behind the layer's GEMMs as far as they last, else exposed;
- context parallel (ring attention, chapter 12): cp − 1 hops of this rank's K, V blocks forward
  (K, V, dK, dV backward), `overlap_cp`: hidden behind the attention that waits for them as
  far as it lasts;
- pipeline: 2·(v·m + pp − 1) stage-to-stage messages of s·b·h/tp on the critical path
  (`scatter_gather`; of s·b·h without it); `overlap_pp` (isend): only the fill's and the
  drain's 2·(pp − 1), and whatever of the others outlasts a micro-batch's compute;
- data parallel: the bf16 gradients reduced over the dp·cp ranks holding the same shard, in
  buckets (25 MiB, DDP's default); `overlap_dp`: every bucket but the last hides behind the last
  micro-batch's backward (the only backward that produces final gradients), else all exposed.
  ZeRO-3 (`zero_stage=3`, FSDP): every layer's weights all-gathered in forward and again in
  backward and its gradients reduce-scattered, for every micro-batch — or once a step when a
  stage keeps its weights gathered and defers the reduction to the last backward
  (`keep_unsharded`, the default under pp as in torchtitan, at 2 + 4 bytes a parameter held);
  `overlap_dp`: prefetched behind the step's compute but for the first layer's gather.
  HSDP (`dp_shard`): the same inside a shard group of dp_shard·cp ranks, and each rank's
  1/shard of the gradients all-reduced over the replicas once a step (the node's NICs shared
  by the replica groups reducing at once), hidden behind the last backward but its last layer;
- the families (`rank_layouts(families=...)`): each layout priced as ZeRO-1, FSDP (ZeRO-3
  over every dp·cp rank) and HSDP (every shard group that fits inside one node), side by side;
- the optimizer step: Adam's update reads and writes every (ZeRO-sharded) state at HBM speed.

Memory of one GPU: model states (bf16 weights and gradients, fp32 master and Adam moments;
ZeRO-`zero_stage` over dp·cp; under `keep_unsharded` the stage's bf16 weights and fp32 gradient
accumulators whole besides) of its stage's layers/tp plus the embedding or head; activations
by memory.activation_breakdown (Korthikanti's accounting with tp, SP, GQA, recompute) for the
micro-batches 1F1B keeps in flight (min(m, pp) on the first stage, × (1 + (pp−1)/(pp·v))
interleaved: Korthikanti §4.2.3); the peak adds what exists only for a moment: with full
recompute one layer's full activations while it is recomputed, and on the last stage the
logits (bf16, their fp32 copy for the loss and its fp32 gradient: 10 bytes per logit).
"""
# One module per idea: shapes.py (the models), search.py (which layouts exist),
# layer_time.py (one layer's seconds), pricing.py (one layout's step and memory),
# ranking.py (all of them, ranked), scaling.py (which axis runs out first as GPUs grow).
from .layer_time import _cluster, _gemm, _gemm_train, layer_seconds  # noqa: F401
from .pricing import BUCKET_BYTES, LOGIT_BYTES, OPTIMIZER_BYTES, price  # noqa: F401
from .ranking import best, rank_layouts, table  # noqa: F401
from .scaling import axis_table, axis_text  # noqa: F401
from .search import FAMILIES, candidates, divisors, families  # noqa: F401
from .shapes import (SHAPES, _BF16, _layer_params, _recompute, attention_flops,  # noqa: F401
                     layer_gemms, model_flops, shape_of)
