"""Which device and which backend a rank uses. A leaf module (it imports only torch), so the
strategies, the cost model and the launcher can all ask without importing each other."""
import torch

NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"   # CPU tensors over gloo, CUDA tensors over NCCL
BACKENDS = ("gloo", "nccl", NCCL_WITH_CPU)

_current = None   # set by the rank's worker once its backend is known


def set_current(dev):
    global _current
    _current = dev


def device():
    """The device this rank should use: cuda:LOCAL_RANK under nccl, else the CPU."""
    return _current if _current is not None else torch.device("cpu")


def choose_backend(world_size):
    """NCCL (with gloo for CPU tensors) when every rank can have its own GPU, gloo otherwise.

    Plain "nccl" has no backend for CPU tensors, and most cells build CPU tensors; the composite
    string gives each device type its own backend. It fails on a build without NCCL, so it is
    chosen only where NCCL exists."""
    import torch.distributed as dist
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size \
            and dist.is_nccl_available():
        return NCCL_WITH_CPU
    return "gloo"


def uses_nccl(backend):
    return "nccl" in backend
