"""Peak memory of ZeRO-3, moment by moment, and what a Llama block keeps for backward.

distlab.memory counts the steady state: sharded model states plus stored activations. A step
needs more at its worst moment: ZeRO-3 gathers a unit's full weights (two units' with
prefetch), autograd produces the unit's FULL gradient before the reduce-scatter cuts it to a
shard, the gradient flowing backward is an activation-sized tensor, and the loss holds the
logits and their gradient. `zero3_peak` walks the step's moments and returns the largest;
`PeakTracker` measures the same thing on real CPU tensors (a tracked allocation peak: every
tensor storage the rank's thread allocates, alive or freed, op by op).

`llama_activations` counts what an eager PyTorch Llama block (`LlamaBlock`: RMSNorm, rotary
embeddings, flash attention, SwiGLU, no dropout, no biases) saves for backward — measured
against the block in chapter 06 and in tests/test_ch06.py, to the byte. Korthikanti et al.'s
34·s·b·h is a GPT block with dropout; Llama's is another count.

The package, one module per idea:
- `llama`: the block, its parameter count, and what it saves for backward;
- `peak`: the step's moments and the largest of them (`zero3_peak`, `llama_zero3_peak`);
- `tracker`: the peak measured on real tensors (`PeakTracker`);
- `step_time`: ZeRO-3's time per block, closed form, and what prefetch hides;
- `conventions`: what "16 bytes per parameter" means, by framework.
"""
from .conventions import CONVENTIONS, convention_bytes  # noqa: F401
from .llama import (LLAMA2_7B, NORM_KERNELS, LlamaBlock, llama_activations,  # noqa: F401
                    llama_block_params, llama_params, rotary, rotary_tables,
                    saved_and_recomputed, saved_bytes)
from .peak import (LLAMA2_13B, _PEAK_PRESETS, llama_zero3_peak, preset_zero3_peak,  # noqa: F401
                   zero3_peak)
from .step_time import (comm_bound_tokens, hiding_tokens, llama_zero3_units,  # noqa: F401
                        zero3_block_seconds, zero3_forward_seconds, zero3_units_seconds)
from .tracker import PeakTracker  # noqa: F401
