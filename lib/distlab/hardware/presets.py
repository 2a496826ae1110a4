"""The calibrated clusters by name, each with its source, and their datasheet twins."""
from .devices import A100, H100, H100_GRAND_TETON, H200
from .fabric import ETH_100G, IB_HDR, IB_NDR, NVLINK3, NVLINK4, Cluster


def _node(name, device, intra, source):
    return Cluster(name, device, intra, None, 8, source, nodes=1)


def _multi(name, device, intra, nic, per_node, nics, source, nodes=None):
    return Cluster(name, device, intra, nic, per_node, source, nics_per_node=nics, nodes=nodes)


# Calibrated clusters: real node shapes (8 GPUs and 8 NICs per node: DGX A100 has 8 HDR
# 200 Gb/s HCAs for compute, DGX H100 8 ConnectX-7 NDR 400 Gb/s — NVIDIA DGX user guides).
PRESETS = {
    "a100-node": _node("one A100 node (8 GPUs, NVLink 3)", A100, NVLINK3,
                       "8 × A100 SXM 80 GB with NVSwitch"),
    "h100-node": _node("one H100 node (8 GPUs, NVLink 4)", H100, NVLINK4,
                       "8 × H100 SXM with NVSwitch"),
    "h200-node": _node("one H200 node (8 GPUs, NVLink 4)", H200, NVLINK4,
                       "8 × H200 SXM with NVSwitch"),
    "a100-2x8": _multi("two A100 nodes (8 GPUs, 8 HDR NICs each)", A100, NVLINK3, IB_HDR, 8, 8,
                       "2 × DGX A100: 8 HDR 200 Gb/s NICs per node", nodes=2),
    "h100-2x8": _multi("two H100 nodes (8 GPUs, 8 NDR NICs each)", H100, NVLINK4, IB_NDR, 8, 8,
                       "2 × DGX H100: 8 NDR 400 Gb/s NICs per node", nodes=2),
    "a100-cluster": _multi("A100 nodes (8 GPUs, 8 HDR NICs each)", A100, NVLINK3, IB_HDR, 8, 8,
                           "DGX A100 SuperPOD-like: any number of nodes"),
    "h100-cluster": _multi("H100 nodes (8 GPUs, 8 NDR NICs each)", H100, NVLINK4, IB_NDR, 8, 8,
                           "DGX H100 SuperPOD-like: any number of nodes"),
    # torchtitan's published H100 runs: "Hosts are inter-connected with backend RDMA network
    # with 400 Gb/s per GPU" — one 400 Gb/s NIC per GPU, modeled as NDR
    "h100-grand-teton": _multi("Grand Teton H100 hosts (8 × 96 GB HBM2e, 500 W; 400 Gb/s per GPU)",
                               H100_GRAND_TETON, NVLINK4, IB_NDR, 8, 8,
                               "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"),
}
DATASHEET = {f"{name}-datasheet": cluster.ideal() for name, cluster in PRESETS.items()}


# The course's first presets, by name, on the calibrated model (distlab.emulate's names
# 'a100-nvlink', 'h100-nvlink', 'h100-ib', 'h100-2nodes' and 'a100-ethernet'):
# the same node shapes, achieved rates, NCCL's latencies, one NIC per GPU across nodes.
CALIBRATED_LEGACY = {
    "a100-nvlink": _node("A100 node", A100, NVLINK3, "calibrated: see distlab.hardware"),
    "h100-nvlink": _node("H100 node", H100, NVLINK4, "calibrated: see distlab.hardware"),
    "h100-ib": _multi("H100s, one per node, over InfiniBand", H100, NVLINK4, IB_NDR, 1, 1,
                      "calibrated: one NDR 400 Gb/s NIC per GPU"),
    "h100-2nodes": _multi("two H100 nodes", H100, NVLINK4, IB_NDR, 4, 4,
                          "calibrated: nodes of 4 H100s, one NDR NIC per GPU", nodes=2),
    "a100-ethernet": _multi("A100s, one per node, over 100 Gb Ethernet", A100, NVLINK3, ETH_100G,
                            1, 1, "calibrated: one 100 Gb/s Ethernet NIC per GPU"),
}
