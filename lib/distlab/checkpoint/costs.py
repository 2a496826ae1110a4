"""What each checkpoint format costs, and how often to save."""
from numbers import Integral, Real


def _positive(function, at_least=None, unit="", **values):
    """Refuse, in one sentence, a value these formulas would divide by (or root) when it is not
    positive: they would raise ZeroDivisionError deep inside or return a complex number."""
    whose = function + ("'" if function.endswith("s") else "'s")
    for name, value in values.items():
        if at_least is not None:
            if isinstance(value, bool) or not isinstance(value, Integral) or value < at_least:
                raise ValueError(f"{whose} {name} must be a whole number >= {at_least}; got "
                                 f"{value!r}.")
        elif isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
            raise ValueError(f"{whose} {name} must be a positive number{unit}; got {value!r}.")


def save_costs(shape, dp, pp, tp, bytes_per_value=4, copies=3):
    """Per rank, for the biggest pipeline stage of `shape` (a hardware.Transformer) under
    (dp, pp, tp): the bytes each format holds at a save and reads at a load, and what the whole
    job writes. `copies`: the tensors saved per parameter (3: fp32 weights and Adam's two
    moments). Embeddings and head count as replicated across tp, as in Stage3D."""
    _positive("save_costs", at_least=1, dp=dp, pp=pp, tp=tp)
    per_layer = (shape.params() - 2 * shape.vocab * shape.hidden) / shape.layers
    layers = -(-shape.layers // pp)                               # the longest stage
    ends = shape.vocab * shape.hidden * (2 if pp == 1 else 1)     # embedding or head
    stage = (layers * per_layer + ends) * bytes_per_value * copies
    sharded = (layers * per_layer / tp + ends) * bytes_per_value * copies
    return {"dense_held": stage, "dense_read": stage, "sharded_held": sharded,
            "sharded_read": sharded,
            "written": shape.params() * bytes_per_value * copies}  # the same in both: dedup


# Llama 3's 54-day pre-training snapshot on 16,384 H100s: 419 unexpected interruptions, 78 % of
# them hardware (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4, Table 5).
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384


def mtbf_seconds(gpus, interruptions=LLAMA3_INTERRUPTIONS, days=LLAMA3_DAYS,
                 observed_gpus=LLAMA3_GPUS):
    """Mean time between interruptions of a job on `gpus` GPUs, if failures strike each GPU
    independently at the rate observed (Llama 3's by default): it shrinks as 1/gpus."""
    _positive("mtbf_seconds", gpus=gpus, interruptions=interruptions, days=days,
              observed_gpus=observed_gpus)
    return days * 86400 / interruptions * observed_gpus / gpus


def young_daly(save_s, mtbf_s):
    """The checkpoint interval that loses the least time (Young 1974, Daly 2006, first order):
    sqrt(2 · C · MTBF), C the time a save stops training. The restart time R does not move it
    (each failure costs R whatever the interval): it only adds to the time lost."""
    _positive("young_daly", unit=" of seconds", save_s=save_s, mtbf_s=mtbf_s)
    return (2 * save_s * mtbf_s) ** 0.5


def lost_fraction(interval_s, save_s, mtbf_s, restart_s=0):
    """The fraction of time lost at interval τ, to first order: C/τ spent saving, plus after
    each failure (one per MTBF) on average τ/2 of work redone and R of restart — requeue,
    process-group init, reading the checkpoint (Daly 2006's R):
    C/τ + (τ/2 + R)/MTBF. With R = 0 it is a lower bound."""
    _positive("lost_fraction", unit=" of seconds", interval_s=interval_s, mtbf_s=mtbf_s)
    for name, value in (("save_s", save_s), ("restart_s", restart_s)):
        if isinstance(value, bool) or not isinstance(value, Real) or value < 0:
            raise ValueError(f"lost_fraction's {name} must be a number of seconds >= 0; got "
                             f"{value!r}.")
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


# Llama 3's checkpoint storage, Meta's Tectonic: 2 TB/s sustained, 7 TB/s peak, shared by the
# whole 16,384-GPU job (Dubey et al. 2024, "The Llama 3 Herd of Models", its infrastructure
# section; read in a summary of the paper, ai-papers.xuzou.cn/papers/llama3_2024).
LLAMA3_STORAGE_SUSTAINED, LLAMA3_STORAGE_PEAK = 2e12, 7e12


def restart_read(bytes_per_rank, gpus, nic_bps, storage_bps=LLAMA3_STORAGE_SUSTAINED):
    """The checkpoint-read part of the restart R, two ways. `storage`: torchrun restarts every
    worker, so all `gpus` ranks read their shards back at once through the shared storage
    (`storage_bps` for the whole job). `peer`: only the newcomer loads its state, from a live
    replica's memory, the same bytes over its own NIC (`nic_bps`), while the others keep theirs."""
    _positive("restart_read", unit="", bytes_per_rank=bytes_per_rank, nic_bps=nic_bps,
              storage_bps=storage_bps)
    _positive("restart_read", at_least=1, gpus=gpus)
    return {"storage": bytes_per_rank * gpus / storage_bps, "peer": bytes_per_rank / nic_bps}
