"""Reading what NCCL says about itself: the `NCCL_DEBUG=INFO` log of a real job, turned into a
small summary (who ran where, which transport joins which ranks, how many channels, the rings and
trees, the NCCL_* settings it echoed, its warnings) and into one-sentence findings.

    log = read(open("job.err").read())       # the lines NCCL printed, mixed with anything else
    for finding in diagnose(log):
        print(finding)

Lines are read one at a time and the summary is built from sets, so the order of the lines (ranks
print in any interleaving) and whatever else the job printed between them do not matter.
"""
import re
from collections import Counter
from dataclasses import dataclass, field

# "host:pid:tid [cudaDev] NCCL INFO message" (also "... [dev] file.cc:12 NCCL WARN message"),
# after whatever prefix a launcher added ("[1,0]<stdout>:", "[rank0]:", a timestamp).
_LINE = re.compile(r"([\w.\-<>]+):(\d+):(\d+) \[(\d+)\] (?:\S+:\d+ )?NCCL (INFO|WARN) ?(.*)")
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+\S*)")
_CONN = re.compile(r"(?:Channel|Ring) (\d+)(?:/\d+)? : (\d+)(?:\[([0-9a-fA-F]+)\])? -> "
                   r"(\d+)(?:\[([0-9a-fA-F]+)\])?(?: \[(send|receive)\])? via (.+)")
_RING = re.compile(r"(?:Channel|Ring) (\d+)(?:/(\d+))? :((?:\s+\d+)+)\s*$")
_NEIGHBOURS = re.compile(r"Ring (\d+) : (-?\d+) -> (\d+) -> (-?\d+)\s*$")
_TREE = re.compile(r"\[(\d+)\] ((?:-?\d+/)*-?\d+)->(\d+)->(-?\d+)")
_COMM = re.compile(r"comm 0x[0-9a-fA-F]+ rank (\d+) n[Rr]anks (\d+)(?: nNodes (\d+))?"
                   r"(?: cudaDev (\d+))?(?: nvmlDev \d+)?(?: busId ([0-9a-fA-F]+))?")
_COLL = re.compile(r"(\d+) coll channels")
_ENV = re.compile(r"(NCCL_[A-Z0-9_]+) set (?:by environment )?to (.*?)\.?\s*$")
_NICS = re.compile(r"\[(\d+)\]([^\s\[\];]+)")
_NETWORK = re.compile(r"Using network (\S+)")
NOT_A_LOG = ("not an NCCL_DEBUG=INFO log: expected lines like 'host:pid:tid [0] NCCL INFO ...' "
             "(run the job with NCCL_DEBUG=INFO and pass the text it printed).")


@dataclass(frozen=True, order=True)
class Connection:
    """One connection: channel, ranks, transport ("P2P", "SHM", "NET/IB", "NET/Socket", ...), the
    rest of its `via` ("CUMEM", "IB/2/GDRDMA"), GPUDirect RDMA or not, NIC index, printing host."""
    channel: int
    src: int
    dst: int
    transport: str
    via: str
    gdr: bool
    nic: int | None
    host: str


@dataclass
class NcclDebugLog:
    """What `read` found; every collection is sorted, so two reads of the same lines in any
    order compare equal."""
    versions: tuple = ()
    nranks: int | None = None
    nnodes: int | None = None
    hosts: tuple = ()
    ranks: dict = field(default_factory=dict)        # rank -> {"host", "device", "bus_id", "nics"}
    connections: tuple = ()
    channels: int | None = None
    rings: dict = field(default_factory=dict)        # channel -> ring order (tuple of ranks)
    trees: dict = field(default_factory=dict)        # channel -> {rank: parent}
    networks: dict = field(default_factory=dict)     # host -> "IB" / "Socket" / plugin name
    nics: dict = field(default_factory=dict)         # host -> {index: NIC} (NET/IB or NET/Socket)
    no_ib: tuple = ()                                # hosts that printed "NET/IB : No device found"
    env: dict = field(default_factory=dict)          # NCCL_* -> value(s) echoed
    warnings: tuple = ()

    @property
    def transports(self):
        """{transport: number of connections}, in name order."""
        return dict(sorted(Counter(c.transport for c in self.connections).items()))


def _transport(via):
    via = via.strip()
    parts = via.split("/")
    if parts[0] == "NET" and len(parts) > 1:
        kind = "NET/IB" if parts[1].startswith("IB") else f"NET/{parts[1]}"
        nic = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
        return kind, "/".join(parts[1:]), "GDRDMA" in via, nic
    return parts[0], "/".join(parts[1:]), "GDRDMA" in via, None


def read(text):
    """Read an NCCL_DEBUG=INFO log (the text, as printed; other lines are skipped) into an
    NcclDebugLog. Anything without a single NCCL line gets a ValueError saying what was expected."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ValueError(NOT_A_LOG)
    versions, hosts, ranks, conns, rings, trees = set(), set(), {}, set(), {}, {}
    networks, nics, no_ib, env, warnings = {}, {}, set(), {}, set()
    nranks, nnodes, counts, hops, seen = set(), set(), set(), {}, False

    def rank(r, host=None, **facts):
        info = ranks.setdefault(r, {"host": None, "device": None, "bus_id": None, "nics": set()})
        for key, value in (("host", host), *facts.items()):
            if value is not None and info[key] is None:
                info[key] = value
        return info

    for raw in text.splitlines():
        v = _VERSION.search(raw)
        if v:
            versions.add(v.group(1))
            seen = True
        m = _LINE.search(raw)
        if not m:
            continue
        seen = True
        host, dev, level, msg = m.group(1), int(m.group(4)), m.group(5), m.group(6).strip()
        hosts.add(host)
        if level == "WARN":
            warnings.add(msg)
            continue
        if c := _CONN.match(msg):
            ch, src, dst = int(c.group(1)), int(c.group(2)), int(c.group(4))
            kind, via, gdr, nic = _transport(c.group(7))
            conns.add(Connection(ch, src, dst, kind, via, gdr, nic, host))
            local = {"send": (src,), "receive": (dst,)}.get(c.group(6), (src, dst))
            for r, tag in ((src, c.group(3)), (dst, c.group(5))):
                if r in local:
                    busy = tag is not None and (len(tag) > 2 or not tag.isdigit())
                    info = rank(r, host, bus_id=tag if busy else None,
                                device=int(tag) if tag and not busy else None)
                    if nic is not None and c.group(6):
                        info["nics"].add((kind, nic))
        elif c := _NEIGHBOURS.match(msg):
            hops.setdefault(int(c.group(1)), {})[int(c.group(3))] = int(c.group(4))
            rank(int(c.group(3)), host, device=dev)
        elif c := _RING.match(msg):
            rings[int(c.group(1))] = tuple(int(x) for x in c.group(3).split())
            if c.group(2):
                counts.add(int(c.group(2)))
        elif msg.startswith("Trees"):
            for ch, _children, me, parent in _TREE.findall(msg):
                trees.setdefault(int(ch), {})[int(me)] = int(parent)
                rank(int(me), host, device=dev)
        elif c := _COMM.search(msg):
            nranks.add(int(c.group(2)))
            if c.group(3):
                nnodes.add(int(c.group(3)))
            rank(int(c.group(1)), host, device=int(c.group(4)) if c.group(4) else dev,
                 bus_id=c.group(5))
        elif c := _COLL.match(msg):
            counts.add(int(c.group(1)))
        elif c := _ENV.search(msg):
            env.setdefault(c.group(1), set()).add(c.group(2).strip())
        elif msg.startswith(("NET/IB : Using", "NET/Socket : Using")):
            kind = "IB" if msg.startswith("NET/IB") else "Socket"
            found = {int(i): name for i, name in _NICS.findall(msg.split(";")[0])}
            nics.setdefault((host, kind), {}).update(found)
        elif msg.startswith("NET/IB : No device found"):
            no_ib.add(host)
        elif c := _NETWORK.match(msg):
            networks.setdefault(host, set()).add(c.group(1))
    if not seen:
        raise ValueError(NOT_A_LOG)
    for ch, nxt in hops.items():          # "Ring 00 : prev -> me -> next" from every rank
        if ch not in rings and nxt:
            order, r = [min(nxt)], nxt.get(min(nxt))
            while r is not None and r != order[0] and r not in order:
                order.append(r)
                r = nxt.get(r)
            if r == order[0]:
                rings[ch] = tuple(order)
    channels = max(counts) if counts else (max(c.channel for c in conns) + 1 if conns else None)
    return NcclDebugLog(
        versions=tuple(sorted(versions)), nranks=max(nranks) if nranks else None,
        nnodes=max(nnodes) if nnodes else None, hosts=tuple(sorted(hosts)),
        ranks={r: dict(i, nics=tuple(sorted(i["nics"]))) for r, i in sorted(ranks.items())},
        connections=tuple(sorted(conns)), channels=channels, rings=dict(sorted(rings.items())),
        trees={ch: dict(sorted(t.items())) for ch, t in sorted(trees.items())},
        networks={h: " ".join(sorted(n)) for h, n in sorted(networks.items())},
        nics={f"{h} ({k})": dict(sorted(n.items())) for (h, k), n in sorted(nics.items())},
        no_ib=tuple(sorted(no_ib)), env={k: " | ".join(sorted(v)) for k, v in sorted(env.items())},
        warnings=tuple(sorted(warnings)))


def _pairs(conns, most=3):
    pairs = sorted({(c.src, c.dst) for c in conns})
    text = ", ".join(f"{a}→{b}" for a, b in pairs[:most])
    return text + (f" and {len(pairs) - most} more" if len(pairs) > most else "")


def diagnose(log):
    """One-sentence findings a learner can act on, most serious first, in a stable order."""
    if isinstance(log, str):
        log = read(log)
    found, conns, env = [], log.connections, log.env
    if len(log.versions) > 1:
        found.append(f"The ranks run different NCCL versions ({', '.join(log.versions)}): "
                     "install one NCCL everywhere (the same container or wheel on every node).")
    socket = [c for c in conns if c.transport == "NET/Socket"]
    if socket:
        why = "NCCL_IB_DISABLE=1 is set" if env.get("NCCL_IB_DISABLE") == "1" else \
            "NCCL found no usable InfiniBand/RoCE device" if log.no_ib else "no IB NIC was used"
        found.append(f"Ranks {_pairs(socket)} talk over NET/Socket (TCP), not InfiniBand ({why}):"
                     " if the nodes have IB/RoCE NICs, check the driver and libibverbs inside the "
                     "container and set NCCL_IB_HCA; otherwise point NCCL_SOCKET_IFNAME at the "
                     "fastest interface.")
    shm = [c for c in conns if c.transport == "SHM"]
    if shm:
        why = "NCCL_P2P_DISABLE=1 is set" if env.get("NCCL_P2P_DISABLE") == "1" else \
            f"NCCL_P2P_LEVEL={env['NCCL_P2P_LEVEL']} is set" if "NCCL_P2P_LEVEL" in env else \
            "P2P between these GPUs is off"
        found.append(f"Ranks {_pairs(shm)} on one node pass data through host memory (SHM), "
                     f"not GPU to GPU ({why}): `nvidia-smi topo -m` shows whether the GPUs share "
                     "NVLink or a PCIe switch; GeForce cards, GPUs under different CPU sockets "
                     "and VMs/containers without P2P fall back to SHM.")
    nogdr = [c for c in conns if c.transport == "NET/IB" and not c.gdr]
    if nogdr:
        found.append(f"Ranks {_pairs(nogdr)} use InfiniBand without GPUDirect RDMA, so data is "
                     "staged in host memory: load the nvidia-peermem module, or check "
                     "NCCL_NET_GDR_LEVEL and the GPU–NIC distance.")
    for name in ("NCCL_ALGO", "NCCL_PROTO"):
        if name in env:
            found.append(f"{name}={env[name]} is forced by the environment: measure without it "
                         "before keeping it (NCCL's tuner picks per size).")
    if log.warnings:
        found.append(f"NCCL printed {len(log.warnings)} warning line(s), e.g. "
                     f"'{log.warnings[0]}': read the first one in time on each node.")
    if log.nranks and len(log.ranks) < log.nranks:
        found.append(f"The log shows {len(log.ranks)} of {log.nranks} ranks: collect every "
                     "node's log (NCCL_DEBUG_FILE=/path/nccl.%h.%p writes one per process).")
    if conns and not found and {c.transport for c in conns} <= {"P2P", "NET/IB"}:
        found.append("Every connection is P2P inside a node or InfiniBand with GPUDirect RDMA "
                     "across nodes: the transports are the fast ones.")
    return found


def summary(log):
    """The summary as a few stable lines of text."""
    lines = [f"NCCL {', '.join(log.versions) or '(version not in the log)'}; "
             f"{log.nranks or '?'} ranks; hosts {', '.join(log.hosts)}; "
             f"{log.channels} channels",
             "transports: " + ", ".join(f"{k} ×{n}" for k, n in log.transports.items())]
    if gdr := sorted({c.transport for c in log.connections if c.gdr}):
        lines.append("GPUDirect RDMA on: " + ", ".join(gdr))
    for r, info in log.ranks.items():
        nic = ", ".join(f"{k}/{i}" for k, i in info["nics"])
        where = info["bus_id"] and f"bus {info['bus_id']}" or f"cuda:{info['device']}"
        lines.append(f"  rank {r:>2}: {info['host']} {where}" + (f", NIC {nic}" if nic else ""))
    for ch, order in log.rings.items():
        lines.append(f"  ring {ch}: {' → '.join(map(str, order))}")
    if log.env:
        lines.append("env: " + ", ".join(f"{k}={v}" for k, v in log.env.items()))
    return "\n".join(lines)
