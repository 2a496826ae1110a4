"""Pipeline parallelism over send/recv: cut a sequential model into stages, run a schedule.

    parts = split_model(model.net, p * v)          # every rank builds the same model, cuts it
    stage = PipelineStage(parts, rank, world_size, in_shape=(16,))
    loss = stage.step(one_f_one_b(p, m)[rank], x, y, m, F.mse_loss)   # grads in .grad

A schedule is a list of actions per stage (distlab.pipeline_schedules). `step` runs this rank's
list in order: a forward receives its input from the previous virtual stage and sends its output
to the next; a backward receives the output's gradient and sends the input's gradient back.
Sends are non-blocking (isend) so a stage never waits for its neighbour to pick a tensor up;
receives block, which is where the bubbles are. Every action's start and end are recorded
(on the rank's virtual clock when the run is emulated: distlab.run(..., emulate=...)).

The core of a step is two methods: `forward` (receive, run the chunk, send) and `backward`
(receive the gradient, autograd, send the input's gradient back); `step` adds the accounting
around them. Placements: "loop" (interleaved), "v" (ZB-V, DualPipeV) and "dual" (the
bidirectional DualPipe: every piece on two ranks, their gradients summed by `sum_dual_copies`).

ZB's split backward works layer by layer, as production implementations do: `I` asks autograd
for the input's gradient and the gradient at every layer output that feeds a weight (autograd
then skips the weight-gradient products), `W` multiplies each by its layer's input. A weight
used twice (a layer applied twice, two layers tied) gets one product per use, each use's own.

Real size: a model built on the meta device runs as is (shapes, no values) under emulation;
`real_size_step` is a pipeline of Llama-2 7B blocks for the chapter's bubble at real size.

A weight in two pieces that land on two stages (an embedding tied to the output head, a layer
used at both ends) is held as a copy on each: the copies start equal and their gradients are
summed before the step (`sum_copies`, in `train`), as DualPipe's twins are.

The package, one module per idea: `stage` (split_model, PipelineStage), `split_backward` (I and
W), `shared` (copies of a parameter on several stages), `training` (train, sum_dual_copies),
`real_size` (Llama blocks on meta, action and message times).
"""
import torch.distributed as dist  # noqa: F401  (tests swap dist.recv / dist.isend through it)

from .real_size import (LLAMA2_7B, LlamaBlock, action_times, llama_parts, message_seconds,
                        real_size_step, weight_grad_seconds)
from .shared import holders, sum_copies, sync_copies
from .split_backward import _input_gradients, _vjp_root, _weight_gradients, _weight_inputs
from .stage import (ACTIVATION, GRADIENT, PipelineStage, _common_clock, _now, _output_shapes,
                    micro_batch_sizes, split_model)
from .training import sum_dual_copies, train
from .fsdp import ShardedStage, pp_dp_mesh, train_sharded  # stages sharded over dp (fsdp)
