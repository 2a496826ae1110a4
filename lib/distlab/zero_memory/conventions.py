"""What "16 bytes per parameter" means, by framework: the bytes each convention keeps."""


# Bytes per parameter one rank keeps for bf16 training with Adam, unsharded, by convention:
# {name: ({kind: bytes}, what is transient on top, source)}. Sharding (ZeRO/FSDP) divides the
# kept kinds by N as memory.model_state_bytes does.
CONVENTIONS = {
    "ZeRO paper / distlab.memory": (
        {"bf16 weights": 2, "bf16 gradients": 2, "fp32 master weights": 4, "Adam moments": 8},
        "nothing", "Rajbhandari et al. 2020, ZeRO, section 3.1 (2 + 2 + 12)"),
    "Megatron-LM (bf16)": (
        {"bf16 weights": 2, "fp32 main gradients": 4, "fp32 master weights": 4,
         "Adam moments": 8},
        "nothing: backward accumulates straight into the fp32 main_grad buffer",
        "Megatron-LM's DistributedDataParallel (accumulate_allreduce_grads_in_fp32, on with "
        "bf16) and its distributed optimizer's fp32 main params"),
    "PyTorch AMP (torch.autocast)": (
        {"fp32 weights": 4, "fp32 gradients": 4, "Adam moments": 8},
        "a bf16 copy of each weight, cast per op and saved for backward: +2",
        "torch.autocast: parameters and .grad stay fp32; matmuls cast their weight to bf16"),
    "FSDP2, bf16 params, fp32 reduce": (
        {"fp32 weight shards": 4, "fp32 gradient shards": 4, "Adam moments": 8},
        "a unit's bf16 weights and bf16 gradient, unsharded, while it runs",
        "torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32): the sharded parameter stays fp32, its .grad an fp32 "
        "shard"),
}


def convention_bytes(name):
    """Bytes per parameter a convention keeps (CONVENTIONS), unsharded."""
    return sum(CONVENTIONS[name][0].values())
