"""The emulated accelerator: time that behaves like devices and links, on a laptop.

N ranks on 2 cores share the CPU, and loopback gloo is not a link, so wall-clock time on a laptop
says little about a cluster. Under `distlab.run(..., emulate="h100-node")` every rank keeps a
VIRTUAL clock instead, advanced only by what a real accelerator would spend time on:

- compute: every tensor operation costs what the modeled device achieves (distlab.hardware):
  max(an eager op's launch floor, FLOPs / (peak · the GEMM's achieved efficiency), bytes touched
  / achieved memory bandwidth) — FLOPs as torch.utils.flop_counter counts them (matmuls,
  convolutions; attention as a flash kernel, half of it when causal), a matmul's efficiency from
  its m, n, k;
- communication: each collective or message occupies the rank's link and completes at NCCL's
  latency plus bus bytes / achieved bus bandwidth (one ring per NIC across nodes), starting when
  every participant has launched it and its link is free. Async handles complete at that
  modeled time: `wait()` moves the caller's clock forward only if the transfer is not done yet.

Every preset is calibrated; `<preset>-datasheet` is the same cluster at datasheet peaks and
line rates. What the calibration rests on, and how close it lands to published measurements,
is in distlab.hardware and bench/fidelity.py. What an emulated time validates: that the code's
critical path (what waits for what, in which order) is what a real run would have; the rates
are the model's, not a measurement.

Real tensors still flow through gloo, so results are exact and identical to a plain run;
only time is modeled. The clocks are deterministic: an emulated timeline is the same on every
run and every machine. Host (Python) overhead costs nothing on the virtual clock.

Full size on a laptop: the model needs shapes, not values. Build the model and its inputs on
the `meta` device inside the rank's function (`with torch.device("meta"): model = ...; x = ...`)
and a 7B block or a large step runs under emulation in seconds (bench/fullsize.py): every op is
charged from its shapes exactly as on real tensors of that shape; a collective or message on
meta tensors is charged on the clock and never reaches gloo; nothing is computed, and the
emulated line says so ("values not computed: meta tensors"). Code that needs a value (`.item()`,
an `if` on a tensor, `.tolist()`, data-dependent routing) stops with a sentence that says to run
it on real tensors at a small size (distlab.trace.MetaValueError); so does sending meta
tensors in a run that is traced but not emulated (a plain run does not look at its tensors).

Ranks agree on when a transfer starts through the launcher's TCP store, outside the process
groups being traced, and launching never waits for a peer: at launch a rank only publishes when
it is ready for the transfer and what its link does before it (`Clock`). The start (the last
member's readiness, once every member's link is free) is worked out when a result is needed:
`wait()`, `is_completed()`, `distlab.trace.completed_at`, a message's receipt, or the end of the
run. So async collectives launched in different orders on different ranks (two groups, each
rank its own order) run as they do plainly. Each rank's link takes its transfers in the order
it launched them; transfers that ranks launched in orders that disagree take every member's link
in one order instead: by when their last member launched them, ties by the lowest member's
launch order. What the host still waits for: working out a start needs every transfer it depends
on through the links to have been launched by all its members. A wait whose transfer is queued
on a peer's link behind a transfer that some member launches only after this wait returns (rank
0: async all_reduce, then send to rank 1; rank 1: receive, then the all_reduce) hangs here: in
this one-link model the message cannot leave before the all_reduce is done (NCCL would run it).
"""
import json


from . import hardware
from .cost import TERMS, Link, terms   # noqa: F401  (Link: the α-β link a Cluster may carry)
from .hardware import Cluster, Device   # noqa: F401  (distlab.emulate.Cluster / Device stay public)


# Every preset is calibrated (distlab.hardware: achieved GEMM and HBM rates, an eager op's launch
# floor, NCCL's latency model, one ring per NIC across nodes). The course's first names
# ('a100-nvlink', 'h100-nvlink', 'h100-ib', 'h100-2nodes', 'a100-ethernet') keep their node
# shapes; `<name>-datasheet` is the same cluster at datasheet rates (no launch floor, GEMMs at
# peak, line-rate links), to show the gap between peak and achieved.
CALIBRATED = {**hardware.CALIBRATED_LEGACY, **hardware.PRESETS}
PRESETS = dict(CALIBRATED)
PRESETS.update({f"{name}-datasheet": cluster.ideal()
                for name, cluster in hardware.CALIBRATED_LEGACY.items()})
PRESETS.update(hardware.DATASHEET)


def resolve(emulate, world_size=None):
    """A Cluster from what a learner passes: a preset name, a Cluster, or None/False; with
    `world_size`, refuses more ranks than the cluster has GPUs."""
    if emulate is None or emulate is False:
        return None
    if isinstance(emulate, Cluster):
        cluster = emulate
    elif isinstance(emulate, str) and emulate in PRESETS:
        cluster = PRESETS[emulate]
    else:
        raise ValueError(
            f"emulate must be the name of a preset ({', '.join(sorted(PRESETS))}) or a "
            f"distlab.emulate.Cluster; got {emulate!r}.")
    if world_size is not None:
        cluster.check_world_size(world_size)
    return cluster


# ---- the cost of one communication on the modeled link --------------------------------------------

# Which α-β term of distlab.cost models each collective on an α-β link: the algorithms NCCL runs
# for large messages, rings. Its broadcast and reduce are pipelined rings too (the message cut
# into chunks streamed down a chain of ranks: (N-1)·α + S/B); its trees serve all_reduce only
# ("NCCL implements broadcast based on the ring algorithm", NVIDIA/nccl#358; tuning.cc skips the
# tree for every collective but all_reduce, NVIDIA/nccl#317).
_MODEL = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
          "reduce_scatter": "ring_reduce_scatter", "broadcast": "ring_broadcast",
          "reduce": "ring_reduce", "all_to_all": "all_to_all", "gather": "ring_all_gather",
          "scatter": "ring_all_gather", "barrier": "ring_all_reduce", "send": "send"}


def comm_seconds(op, nbytes, world_size, link):
    """Modeled seconds of `op` moving `nbytes` (the full tensor for gathers and scatters): the
    calibrated link's own model (distlab.hardware.Link), or α-β on a distlab.cost.Link."""
    if hasattr(link, "seconds"):
        return link.seconds(op, nbytes, world_size)
    if not (hasattr(link, "alpha") and hasattr(link, "bandwidth")):
        raise ValueError(f"link must be a distlab.hardware.Link (a cluster's .intra, or "
                         f"cluster.link_between(ranks)) or a distlab.cost.Link; got {link!r}.")
    if op not in _MODEL:
        raise ValueError(f"unknown collective {op!r}; the emulator knows {sorted(_MODEL)}.")
    messages, volume = terms(_MODEL[op], nbytes, world_size)     # checks the sizes
    if world_size <= 1 and op != "send":
        return 0.0
    return messages * link.alpha + volume / link.bandwidth


# ---- the rank's side: a virtual clock and a link that serialises transfers -----------------------

class Clock:
    """One rank's virtual time (seconds) and the transfers on its link.

    Every transfer this rank takes part in is a node: at launch the rank publishes in the
    store, without waiting, when it is ready for it (its clock), what its link does before
    it (the transfer it launched last, or the time its link is free), and how long the transfer
    occupies its link. The start of a transfer (the latest member's readiness, once each
    member's link is free) is worked out only when somebody needs it: `resolve`."""

    def __init__(self, cluster, store, rank, store_world_size=1):
        self.cluster, self.store, self.rank = cluster, store, rank
        self.store_world_size = store_world_size
        self.now = 0.0
        self.link_free = 0.0          # when the link is free after the transfers resolved so far
        self._last = None             # the last transfer launched here, while not resolved
        self._index = 0               # this rank's transfers so far (the order it launched them)
        self._seq = {}
        self._entries = {}            # (key, rank) -> (ready, after, seconds, index)
        self._start = {}              # key -> agreed start
        self._free = {}               # (key, rank) -> when that rank's link is free after it

    def compute(self, flops, nbytes, dtype, mnk=None):
        self.now += self.cluster.device.seconds(flops, nbytes, dtype, mnk)

    def _next(self, key):
        n = self._seq.get(key, 0)
        self._seq[key] = n + 1
        return n

    # -- launching: publish, never wait -----------------------------------------------------------
    def _launch(self, key, members, seconds):
        self._forget_resolved()
        # What this rank's link does before the new transfer: the transfer launched before it
        # while nobody knows its start yet, else the time the link is free.
        after = self._last if self._last is not None else self.link_free
        entry = (self.now, after, seconds, self._index)
        self._index += 1
        self._entries[(key, self.rank)] = entry
        self.store.set(f"{key}/{self.rank}", json.dumps(entry))
        node = (key, tuple(members))
        self._last = node
        return node

    def collective(self, op, nbytes, ranks, group_name):
        """Launch a collective of the group `ranks`; returns its node (see `resolve`)."""
        key = f"c/{group_name}/{self._next(('c', group_name))}"
        return self._launch(key, ranks, comm_seconds(op, nbytes, len(ranks),
                                                     self.cluster.link_between(ranks)))

    def unsynchronised(self, op, nbytes):
        """Launch a collective whose peers cannot be asked (issued from C++): the whole world,
        starting when this rank's link is free."""
        world = self.store_world_size
        key = f"n/{self.rank}/{self._next('n')}"
        return self._launch(key, (self.rank,), comm_seconds(
            op, nbytes, world, self.cluster.link_between(range(world))))

    def send(self, nbytes, dst, tag):
        """Launch a message to global rank `dst`; the receiver learns its arrival (`arrival`)."""
        key = f"p/{self.rank}/{dst}/{tag}/{self._next(('p', self.rank, dst, tag))}"
        return self._launch(key, (self.rank,), comm_seconds(
            "send", nbytes, 2, self.cluster.link_between((self.rank, dst))))

    def arrival(self, src, tag):
        """When the next message from global rank `src` with `tag` arrives (waits for its send)."""
        key = f"p/{src}/{self.rank}/{tag}/{self._next(('p', src, self.rank, tag))}"
        self.resolve((key, (src,)))
        return self._free[(key, src)]

    # -- resolving: when a result is needed -------------------------------------------------------
    def resolve(self, node):
        """(start, done) of a transfer this rank launched: waits (on the host) until every
        transfer its start depends on has been launched by all of its members."""
        key, members = node
        if key not in self._start:
            self._solve(node)
        self._forget_resolved()
        start = self._start[key]
        if self.rank not in members:
            return start, None
        return start, start + self._entries[(key, self.rank)][2]

    def _forget_resolved(self):
        if self._last is not None and self._last[0] in self._start:
            self.link_free, self._last = self._free[(self._last[0], self.rank)], None

    def _entry(self, key, members):
        missing = [m for m in members if (key, m) not in self._entries]
        if missing:
            values = self.store.multi_get([f"{key}/{m}" for m in missing])
            for m, v in zip(missing, values):
                ready, after, seconds, index = json.loads(v)
                if isinstance(after, list):
                    after = (after[0], tuple(after[1]))
                self._entries[(key, m)] = (ready, after, seconds, index)
        return [self._entries[(key, m)] for m in members]

    def _after(self, key, members):
        """The unresolved transfers that `key`'s members' links do before it."""
        out = []
        for m, (_, after, _, _) in zip(members, self._entry(key, members)):
            if isinstance(after, tuple) and after[0] not in self._start:
                out.append(after)
        return out

    def _free_before(self, key, m):
        """When member m's link is free for `key` (the transfer before it there is resolved)."""
        after = self._entries[(key, m)][1]
        return after if not isinstance(after, tuple) else self._free[(after[0], m)]

    def _solve(self, node):
        # Tarjan's strongly connected components over "must wait for": dependencies come out
        # first. A component of several transfers is a cycle: ranks launched them in orders
        # that disagree.
        index, low, stack, on_stack, order = {}, {}, [], set(), []
        work = [(node, iter(self._after(*node)))]
        index[node[0]] = low[node[0]] = 0
        stack.append(node)
        on_stack.add(node[0])
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is not None:
                if w[0] not in index:
                    index[w[0]] = low[w[0]] = len(index)
                    stack.append(w)
                    on_stack.add(w[0])
                    work.append((w, iter(self._after(*w))))
                elif w[0] in on_stack:
                    low[v[0]] = min(low[v[0]], index[w[0]])
                continue
            work.pop()
            if work:
                low[work[-1][0][0]] = min(low[work[-1][0][0]], low[v[0]])
            if low[v[0]] == index[v[0]]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w[0])
                    component.append(w)
                    if w[0] == v[0]:
                        break
                self._schedule(component)

    def _schedule(self, component):
        """Start times of a set of transfers whose dependencies are resolved. One transfer
        starts when its last member is ready and every member's link is free. Transfers that
        ranks launched in disagreeing orders take every member's link in one order instead: by
        when their last member launched them, ties by the lowest member's launch order."""
        keys = {key for key, _ in component}

        def launched(node):
            key, members = node
            entries = self._entries
            return (max(entries[(key, m)][0] for m in members), min(members),
                    entries[(key, min(members))][3])
        free = {}
        for key, members in component:
            for m in members:
                after = self._entries[(key, m)][1]
                if not (isinstance(after, tuple) and after[0] in keys):
                    free[m] = self._free_before(key, m)    # where m's link enters the set
        for key, members in sorted(component, key=launched):
            start = max(max(self._entries[(key, m)][0], free[m]) for m in members)
            self._start[key] = start
            for m in members:
                free[m] = start + self._entries[(key, m)][2]
        for key, members in component:
            for m in members:
                self._free[(key, m)] = free[m]


def describe(cluster, meta=False):
    """The one line every emulated output carries (`meta`: the run held meta tensors)."""
    values = "; values not computed: meta tensors" if meta else ""
    return f"⏱ emulated: {cluster}. Times are modeled, not measured on this machine{values}."


_announced = None


def announce(cluster, meta=False):
    """Print describe(cluster, meta) once per notebook cell and cluster (every time outside a
    notebook): a cell that runs a sweep of emulated runs says it once, not once per run."""
    global _announced
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    cell = None
    if shell is not None:
        # One execute request per cell; nbval runs cells without history, so the execution
        # count does not tell cells apart, but the request's message id does.
        header = getattr(shell, "parent_header", None) or {}
        cell = header.get("header", {}).get("msg_id") or (id(shell), shell.execution_count)
    if cell is None or _announced != (cell, cluster, meta):
        print(describe(cluster, meta))
        _announced = (cell, cluster, meta)
