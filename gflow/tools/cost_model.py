"""A calibrated cost model of gflow's allreduce and of a data-parallel training step, 1..512+ ranks.

    mpiexec -n 4 python -m gflow calibrate --out calib.json     # measure this machine's constants
    python -m gflow model --ranks 512 --ranks-per-node 8 --link 56gbit --workload alexnet

Constants (a calibration; DEFAULTS are the development machine's, bench/RESULTS.md "Scale"), all in
seconds, per byte or per element, for a rank that has a core to itself:

    alpha_intra, beta_intra   one message inside a node: latency, and seconds per byte
    alpha_inter, beta_inter   one message between nodes (beta_inter: one flow alone on the node's link)
    gamma                     reducing one byte of output (two operands in, one out)
    copy                      copying one byte (the shared-memory node phase is made of copies and
                              one fused reduction, costed as `node_passes` copies per byte)
    codec                     float16 encode + decode, per element
    csc                       CSC's local work per gradient element per step
    py_step                   gflow's own cost per ring step or segment beyond the message's latency
                              (compiled loops: collectives/native.py; GFLOW_NATIVE=0: Python's)
    py_call                   the Python of one bandwidth-sized call outside its steps (checks,
                              dispatch, buffers), paid once per allreduce
    rd_step                   gflow's own cost per round of recursive doubling (the latency path and
                              the agreement before a ring), the fast lane's share of its call included
    node_fixed                the node phase's fixed cost (two barriers and its bookkeeping)
    slot_step                 one exchange through the shared slots of one host's ranks (the latency
                              path's whole call, its Python included; collectives/shared_slots.py),
                              where every exchange of a one-host communicator goes; None: not
                              measured (the model then takes MPI's rounds there too)
    ring_scale                measured / modelled bandwidth terms of a ring inside a node (MPI's
                              shared-memory transport and cache effects the terms above miss), at
                              8 MB; ring_scale_small, ring_scale_large and ring_scale_huge the same
                              at 512 KiB, 32 MB and 128 MB, and the model interpolates in log size
                              between them
    slots_scale               the same for the bytes reduced in one host's slots (a payload copied
                              in and folded by every rank, from the caches at these sizes)
    node_passes_small         node_passes at SMALL_BYTES, where the node phase's buffers stay in
                              the caches (node_passes itself is measured at 32 MB); node_passes_mid
                              and node_passes_huge the same at 8 MB and 128 MB (past the last
                              level cache, memory's bandwidth is shared); the model interpolates in
                              log size between them

`calibrate` fits the terms from py_step on from gflow's own allreduces at a few sizes on the
calibration's communicator (a tiny ring of one segment per chunk and of 33, whose difference is the
cost of a step and whose rest is the call's; a tiny, a 512 KiB, an 8 MB, a 32 MB and a 128 MB node
phase, a 512 KiB, an 8 MB, a 32 MB and a 128 MB ring inside the node, a tiny and a 512 KiB "auto"
allreduce through the slots, a tiny recursive doubling); everything else it predicts is held out
(bench/model_check.py). Each timing is the median of REPEATS batches.

A node of k ranks on c cores runs its CPU-bound terms ceil(k/c) times slower when k > c (`cores`),
which is what happens on the 2-core development machine at p = 3 and 4. Its fixed costs (latency,
Python steps, barriers) are set by the scheduler then, and do not scale that way: `calibrate` on one
node with more ranks than cores also measures them with one rank per core (`uncrowded`), which the
model uses for nodes of at most c ranks. The model of each algorithm
follows its code:

- ring: 2(p-1) steps; reduce-scatter steps move ceil(chunk / segment) segments each and reduce
  them (the code overlaps a segment's reduction with the next one's transfer, but the same cores do
  both, so the model adds them); a step waits for the slowest link it crosses.
- recursive doubling (messages up to config.small_message_bytes, 16x that at p = 2 under "auto"; an
  explicit algorithm="recursive_doubling" above small_message_bytes is refused, as gflow refuses it):
  log2 of the largest power of two <= p rounds (+2, the fold and unfold, when p is not one), each a
  whole message; a round across nodes lasts as long as its busiest link (the ranks of a node that
  cross in it send at once); device arrays reduce on the host. On one host (slot_step measured):
  one exchange through the slots, every rank copying its message in and folding all p; the agreement
  before a bandwidth algorithm is one such exchange too, and from three ranks "auto" reduces up to
  the node phase's threshold in the slots: whole below node_fold_bytes, else a share per rank in two
  exchanges (a copy in, a fold of 1/p from every rank, a copy out).
- hierarchical: the node phase (shared memory: node_passes copies per byte and two barriers; or
  a ring inside the node), then a ring per shard across the m nodes, whose k flows share each node's
  link, so 2(m-1)/m of the message crosses it instead of the flat ring's 2(p-1)/p.
- fp16 halves the bytes and adds the codec; CSC at density d adds its local work, an allreduce of
  the chunk norms, and a dense allreduce of d of the bytes; lazy fusion groups a parameter list into
  segments of at least the threshold; overlap hides communication behind the backward pass (2/3 of
  the compute) except the last segment's.

(Long: every term of the model is here with where it comes from, so that one file is checked
against bench/RESULTS.md.)
"""

import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..collectives.dispatch import check_recursive_doubling_size
from ..collectives.recursive_doubling import HEADER_BYTES, node_fold_bytes, slot_room
from ..runtime.config import (
    DEFAULT_HIERARCHICAL_MIN_BYTES,
    DEFAULT_RING_SEGMENT_BYTES,
    DEFAULT_SHARED_MEMORY_MIN_BYTES,
    DEFAULT_SMALL_MESSAGE_BYTES,
    latency_path_limit,
)
from ..runtime.context import rd_schedule
from .workloads import MODELS

STAGING_SEGMENT_BYTES = 4 * 2**20  # collectives/hierarchical.py's: device shards cross nodes in these

BACKWARD_SHARE = 2 / 3  # of a step's compute: what communication can hide behind
CALIBRATION_ENV = "GFLOW_CALIBRATION"
LAST_CALIBRATION = os.path.join(os.path.expanduser("~"), ".cache", "gflow", "calibration.json")


@dataclass
class Calibration:
    alpha_intra: float = 12e-6
    beta_intra: float = 1 / 2.5e9
    alpha_inter: float = 60e-6
    beta_inter: float = 1 / 0.117e9
    gamma: float = 1 / 3.0e9
    copy: float = 1 / 5.5e9
    node_passes: float = 4.0
    node_fixed: float = 60e-6
    ring_scale: float = 1.0
    rd_step: float = 25e-6
    codec: float = 1.2e-9
    csc: float = 6e-9
    py_step: float = 25e-6
    py_call: float = 0.0  # (calibrations before it was measured folded it into py_step)
    slot_step: float | None = None  # (calibrations before the slots have none)
    cores: int = 2
    source: str = "documented defaults (the 2-core development machine)"
    # The fixed costs (alpha_intra, py_step, py_call, rd_step, node_fixed) measured again with one rank per
    # core, when the calibration ran more ranks than cores on one node; None: not measured.
    uncrowded: dict | None = None
    # ring_scale measured at RING_SCALE_BYTES[1] (_large) and at SMALL_BYTES (_small), ring_scale itself
    # at [0]; between them the model interpolates in log size (caches make a ring's bytes dearer as
    # messages grow). None: not measured (older calibrations).
    ring_scale_large: float | None = None
    ring_scale_small: float | None = None
    ring_scale_huge: float | None = None  # at HUGE_BYTES (None: ring_scale_large's beyond 32 MB)
    slots_scale: float = 1.0  # (calibrations before it was measured: 1)
    node_passes_small: float | None = None  # None: node_passes at every size
    node_passes_mid: float | None = None  # at RING_SCALE_BYTES[0], and
    node_passes_huge: float | None = None  # at HUGE_BYTES (None: not measured, older calibrations)
    # The device path (cluster(gpu=True) sets it; None: host arrays): "direct" (a CUDA-aware MPI reads
    # device memory; the latency path still stages its small messages through the host) or "staged"
    # (through pinned host memory: the flat ring and the latency path stage the whole message, the
    # hierarchical allreduce only its cross-node shards, pipelined). pcie: seconds per byte between
    # device and host, each direction. launch: one kernel launch and the stream sync after it, paid per
    # ring step and per kernel of the node phase (assumed until `calibrate --device` measures it).
    transport: str | None = None
    pcie: float = 1 / 12e9
    launch: float = 10e-6
    # The GPU `calibrate --device` measured launch and pcie on; None: both are assumed (the values above).
    device: str | None = None
    # The host's reduction and shared memory, where device arrays take the latency path through the
    # host (cluster(gpu=True) keeps them from the base calibration; None: gamma and beta_intra).
    host_gamma: float | None = None
    host_beta_intra: float | None = None

    @classmethod
    def load(cls, path: str | None = None) -> "Calibration":
        """A calibration from `path`; None: $GFLOW_CALIBRATION, else the installed one (`gflow
        calibrate --install`: ~/.cache/gflow/calibration.json), else the defaults."""
        path = (
            path
            or os.environ.get(CALIBRATION_ENV)
            or (LAST_CALIBRATION if os.path.exists(LAST_CALIBRATION) else None)
        )
        if path is None:
            return cls()
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"calibration {path}: not a JSON calibration ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"calibration {path}: expected a JSON object of constants")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        optional = {"source", "uncrowded", "ring_scale_large", "py_call", "transport", "pcie", "launch"}
        optional |= {"device", "slots_scale", "node_passes_small", "ring_scale_small", "slot_step"}
        optional |= {"ring_scale_huge", "node_passes_mid", "node_passes_huge"}
        optional |= {"host_gamma", "host_beta_intra"}
        missing = sorted(set(cls.__dataclass_fields__) - set(known) - optional)
        if missing:
            raise ValueError(
                f"calibration {path}: missing {', '.join(missing)} "
                "(from an older gflow? run `gflow calibrate` again)"
            )
        for name, value in known.items():  # (a string or a negative time would fail deep in the model)
            if name in _NOT_NUMBERS or (value is None and name in _MAY_BE_NONE):
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if name == "cores" and not (number and value == int(value) and value >= 1):
                raise ValueError(f"calibration {path}: cores must be a whole number >= 1, got {value!r}")
            if not (number and (value > 0 if name in _POSITIVE else value >= 0)):
                least = "a positive number" if name in _POSITIVE else "a number >= 0"
                raise ValueError(f"calibration {path}: {name} must be {least}, got {value!r}")
        if known.get("transport") not in (None, "direct", "staged"):
            raise ValueError(f"calibration {path}: transport must be 'direct', 'staged' or null")
        uncrowded = known.get("uncrowded")
        if uncrowded is not None and not (
            isinstance(uncrowded, dict)
            and all(k in _FIXED_COSTS and isinstance(v, (int, float)) for k, v in uncrowded.items())
        ):
            raise ValueError(f"calibration {path}: uncrowded must map {', '.join(_FIXED_COSTS)} to seconds")
        known.setdefault("source", path)
        return cls(**known)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)


def _for_node(cal: Calibration, ranks_on_node: int) -> Calibration:
    """cal as it applies to nodes of ranks_on_node ranks: with one rank per core or fewer, the fixed
    costs measured that way, when the calibration has them. Under oversubscription a barrier or a
    ring step waits for a rank the scheduler has set aside, so the fixed costs measured with more
    ranks than cores do not shrink by the core count the way the bandwidth terms do."""
    if ranks_on_node <= cal.cores and cal.uncrowded:
        return replace(cal, **{k: v for k, v in cal.uncrowded.items() if k in _FIXED_COSTS})
    return cal


# (a rate or a scale of 0 would make bytes free: node_passes 0 cut a ResNet-50 step's communication 4x)
_POSITIVE = ("beta_intra", "beta_inter", "gamma", "copy", "codec", "csc", "pcie", "slots_scale",
             "node_passes", "node_passes_small", "node_passes_mid", "node_passes_huge",
             "ring_scale", "ring_scale_small", "ring_scale_large", "ring_scale_huge", "host_gamma",
             "host_beta_intra")  # fmt: skip
# None: not measured (older calibrations)
_MAY_BE_NONE = ("slot_step", "ring_scale_small", "ring_scale_large", "ring_scale_huge", "node_passes_small",
                "node_passes_mid", "node_passes_huge", "host_gamma", "host_beta_intra")  # fmt: skip
_NOT_NUMBERS = ("source", "uncrowded", "transport", "device")
_FIXED_COSTS = ("alpha_intra", "py_step", "py_call", "rd_step", "node_fixed", "slot_step")
_PYTHON_COSTS = ("py_step", "py_call", "rd_step")  # what gflow's own code costs, beside the machine's
RING_SCALE_BYTES = (8 * 2**20, 32 * 2**20)  # where calibrate measures a ring inside a node
HUGE_BYTES = 128 * 2**20  # ... and both, where every rank's buffers are far past the caches
SMALL_BYTES = 512 * 2**10  # where it measures the node phase in the caches and the slots' bytes
LOCAL_BYTES = 32 * 2**20  # where it measures gamma, copy and node_passes


def _by_size(nbytes: float, points) -> float:
    """The value at nbytes of (bytes, value) points measured at a few sizes (those whose value is None
    left out): interpolated in log size between them, the end values beyond them."""
    known = [(math.log2(b), v) for b, v in points if v is not None]
    sizes, values = zip(*known, strict=True)
    return float(np.interp(math.log2(max(nbytes, 1)), sizes, values))


def _ring_scale(cal: Calibration, nbytes: int) -> float:
    points = [(SMALL_BYTES, cal.ring_scale_small), (RING_SCALE_BYTES[0], cal.ring_scale)]
    return _by_size(
        nbytes, [*points, (RING_SCALE_BYTES[1], cal.ring_scale_large), (HUGE_BYTES, cal.ring_scale_huge)]
    )


def _node_passes(cal: Calibration, nbytes: int) -> float:
    """node_passes for a node phase of nbytes: node_passes_small at SMALL_BYTES, node_passes_mid at
    RING_SCALE_BYTES[0], node_passes at LOCAL_BYTES, node_passes_huge at HUGE_BYTES."""
    points = [(SMALL_BYTES, cal.node_passes_small), (RING_SCALE_BYTES[0], cal.node_passes_mid)]
    return _by_size(nbytes, [*points, (LOCAL_BYTES, cal.node_passes), (HUGE_BYTES, cal.node_passes_huge)])


def _slowdown(cal: Calibration, ranks_on_node: int) -> float:
    """How much slower a node's CPU-bound work runs with ranks_on_node ranks on cal.cores cores. Whole
    multiples: the ranks work in lockstep (a ring step, a barrier), so a core shared by two ranks holds
    back every rank, even where the other cores have one."""
    return float(max(1, math.ceil(ranks_on_node / cal.cores)))


def _ring_parts(cal, nbytes, p, alpha, beta, cpu, flows=1, network=False):
    """(fixed, bandwidth) seconds of a ring over p ranks whose steps cross links of (alpha, beta)
    shared by `flows` flows; network: the links are between nodes. On the device each step also
    launches its reduction and waits for it."""
    if p == 1 or nbytes == 0:
        return 0.0, 0.0
    chunk = nbytes / p
    segments = max(1, math.ceil(chunk / DEFAULT_RING_SEGMENT_BYTES))
    step = cpu * cal.py_step + alpha + (cal.launch if cal.transport else 0.0)
    fixed = (p - 1) * (segments + 1) * step
    if network:  # the cores reduce one segment while the link carries the next
        bandwidth = (p - 1) * chunk * (flows * beta + max(flows * beta, cpu * cal.gamma))
    else:  # inside a node the same cores move and reduce
        bandwidth = (p - 1) * chunk * (2 * flows * beta + cpu * cal.gamma)
    return fixed, bandwidth


def _ring(cal, nbytes, p, alpha, beta, cpu, flows=1, scale=1.0, network=False):
    fixed, bandwidth = _ring_parts(cal, nbytes, p, alpha, beta, cpu, flows, network)
    return fixed + scale * bandwidth


def rd_round_count(p: int) -> int:
    """Exchanges one rank waits for in gflow's recursive doubling (runtime/context.rd_schedule): log2 of
    the largest power of two <= p, and the fold and unfold of the ranks beyond it."""
    if p <= 1:
        return 0
    whole = p.bit_length() - 1
    return whole + (0 if p == 1 << whole else 2)


@functools.lru_cache(maxsize=256)
def rd_rounds(p: int, k: int) -> tuple:
    """For each round of gflow's recursive doubling on p ranks in nodes of k consecutive ranks: how
    many ranks of the busiest node send across nodes in it (0: the round stays inside the nodes)."""
    schedules = [rd_schedule(r, p) for r in range(p)]
    rem = p - (1 << (p.bit_length() - 1))
    senders = []  # per round, (rank, peer) of the ranks that send
    fold = [(r, r + 1) for r in range(0, 2 * rem, 2)]
    if fold:
        senders.append(fold)
    for i in range(rd_round_count(p) - (2 if rem else 0)):
        senders.append([(r, rounds[i][0]) for r, (_, rounds) in enumerate(schedules) if rounds])
    if fold:
        senders.append([(b, a) for a, b in fold])
    counts = []
    for pairs in senders:
        across = {}
        for r, peer in pairs:
            if r // k != peer // k:
                across[r // k] = across.get(r // k, 0) + 1
        counts.append(max(across.values(), default=0))
    return tuple(counts)


def _agreement(cal, p, alpha, cpu, inside: int = 0, one_host: bool = False):
    """The header-only exchange before a bandwidth algorithm; `inside` of its rounds stay in a node;
    one_host: host buffers of ranks on one host, one exchange through the slots where measured."""
    if one_host and p > 1 and cal.slot_step is not None:
        return cpu * cal.slot_step
    rounds = rd_round_count(p)
    inside = min(inside, rounds)
    return inside * (cal.alpha_intra + cpu * cal.rd_step) + (rounds - inside) * (alpha + cpu * cal.rd_step)


def allreduce_time(
    nbytes: int,
    ranks: int,
    *,
    algorithm: str = "auto",
    ranks_per_node: int | None = None,
    compression: str | None = None,
    calibration=None,
    dtype_bytes: int = 4,
) -> float:
    """Predicted seconds of one gflow.allreduce of nbytes (of float32 unless dtype_bytes says) on
    `ranks` ranks, nodes of ranks_per_node (None: one node holding every rank).

    algorithm: "auto" (as gflow.allreduce settles it with the default thresholds), "ring",
    "recursive_doubling" or "hierarchical". compression: None, "fp16" or "bf16" (costed alike: the
    calibrated codec is fp16's, an upper bound for bf16's on the host). calibration: a Calibration,
    a JSON path, or None (see Calibration.load)."""
    cal = calibration if isinstance(calibration, Calibration) else Calibration.load(calibration)
    if ranks < 1 or nbytes < 0:
        raise ValueError(f"need ranks >= 1 and nbytes >= 0, got ranks={ranks}, nbytes={nbytes}")
    k = min(ranks_per_node or ranks, ranks)
    m = math.ceil(ranks / k)
    cal = _for_node(cal, k)
    cpu = _slowdown(cal, k)
    codec = 0.0
    if compression in ("fp16", "bf16"):
        codec = cpu * cal.codec * nbytes / dtype_bytes
        nbytes = nbytes * 2 // dtype_bytes
    elif compression is not None:
        raise ValueError(f"compression: expected None, 'fp16' or 'bf16', got {compression!r}")
    if algorithm == "recursive_doubling":
        check_recursive_doubling_size(nbytes, DEFAULT_SMALL_MESSAGE_BYTES)
    if ranks == 1:
        return codec + cpu * cal.copy * nbytes
    alpha_x, beta_x = (cal.alpha_inter, cal.beta_inter) if m > 1 else (cal.alpha_intra, cpu * cal.beta_intra)
    # Device memory through the host, whole: the latency path always (it reads its header there),
    # the flat ring where MPI is not CUDA-aware.
    through_host = 2 * nbytes * cal.pcie + 2 * cal.launch if cal.transport else 0.0
    slots = m == 1 and not cal.transport and cal.slot_step is not None  # (shared_slots.py's exchanges)
    if algorithm == "auto":  # as collectives/dispatch.py settles it
        if nbytes <= latency_path_limit(ranks, DEFAULT_SMALL_MESSAGE_BYTES):
            algorithm = "recursive_doubling"
        elif slots and ranks > 2 and nbytes < DEFAULT_SHARED_MEMORY_MIN_BYTES:
            # (dispatch._may_reduce_in_slots; past a slot's room, the ring after the slots' agreement)
            algorithm = "slots" if nbytes + HEADER_BYTES <= slot_room(ranks) else "ring"
        elif m > 1:
            algorithm = "hierarchical" if k > 1 and nbytes >= DEFAULT_HIERARCHICAL_MIN_BYTES else "ring"
        else:  # (device arrays: the IPC node phase from two ranks; host ones from three)
            least = 2 if cal.transport else 3
            algorithm = "hierarchical" if k >= least and nbytes >= DEFAULT_SHARED_MEMORY_MIN_BYTES else "ring"
    if algorithm == "slots" or (slots and algorithm == "recursive_doubling"):
        fixed, bandwidth = _slots_parts(cal, nbytes, ranks, latency_path=algorithm != "slots")
        scale = cal.slots_scale if nbytes + HEADER_BYTES <= slot_room(ranks) else 1.0  # (where measured)
        return codec + cpu * (fixed + scale * bandwidth)
    if algorithm == "recursive_doubling":
        # Device arrays take this path through the host: the host's reduction and shared memory.
        gamma = cal.host_gamma if cal.transport and cal.host_gamma else cal.gamma
        beta_near = cal.host_beta_intra if cal.transport and cal.host_beta_intra else cal.beta_intra
        near = cal.alpha_intra + cpu * cal.rd_step + nbytes * (cpu * beta_near + cpu * gamma)
        # A round across nodes lasts as long as its busiest link: `flows` ranks of one node send their
        # whole message over it at once.
        rounds = rd_rounds(ranks, k) if m > 1 else (0,) * rd_round_count(ranks)
        step = alpha_x + cpu * cal.rd_step + nbytes * cpu * gamma
        far = [step + nbytes * flows * beta_x for flows in rounds if flows]
        return codec + through_host + sum(far) + (len(rounds) - len(far)) * near
    inside = rd_rounds(ranks, k).count(0) if m > 1 else 0
    agree = cpu * cal.py_call + _agreement(cal, ranks, alpha_x, cpu, inside, slots)
    if algorithm == "ring":
        scale = _ring_scale(cal, nbytes) if m == 1 else 1.0
        ring = _ring(cal, nbytes, ranks, alpha_x, beta_x, cpu, scale=scale, network=m > 1)
        return codec + agree + (through_host if cal.transport == "staged" else 0.0) + ring
    if algorithm != "hierarchical":
        raise ValueError(
            f"algorithm: expected auto, ring, recursive_doubling or hierarchical, got {algorithm!r}"
        )
    node = 0.0
    if k > 1:
        node = cpu * (cal.node_fixed + _node_passes(cal, nbytes) * cal.copy * nbytes)
        if cal.transport:  # peers' device memory through CUDA IPC: over the node's links, a kernel each
            node += 2 * (k - 1) / k * nbytes * cal.beta_intra + (k + 3) * cal.launch
    return codec + agree + node + _cross_node(cal, nbytes / k, m, k, cpu)


def _slots_parts(cal: Calibration, nbytes: int, p: int, latency_path: bool) -> tuple:
    """(fixed, bytes) seconds, on a core of one's own and before slots_scale, of an allreduce reduced in
    one host's slots: the latency path (one exchange, every rank folding every payload) or "auto"
    past it (recursive_doubling's reduce_in_slots: below node_fold_bytes one exchange, every rank
    folding every payload; past it two, each rank folding its 1/p of every payload and then copying
    every share out)."""
    if latency_path:
        return cal.slot_step, nbytes * (cal.copy + (p - 1) * cal.gamma)
    if nbytes <= node_fold_bytes(p):
        return cal.py_call + cal.slot_step, nbytes * (cal.copy + (p - 1) * cal.gamma)
    return cal.py_call + 2 * cal.slot_step, nbytes * (2 * cal.copy + (p - 1) / p * cal.gamma)


def _cross_node(cal: Calibration, shard: float, m: int, k: int, cpu: float) -> float:
    """The hierarchical allreduce's ring of one shard across m nodes, whose k flows share each node's
    link. Device arrays go in segments of STAGING_SEGMENT_BYTES, a ring each; staged ones copy each
    segment in and out while the next and the previous ring run (pipelined: the slower of the copies
    and the rings, plus one segment's copies to fill and drain the pipeline)."""
    if m == 1:
        return 0.0
    if not cal.transport:
        return _ring(cal, shard, m, cal.alpha_inter, cal.beta_inter, cpu, flows=k, network=True)
    count = max(1, math.ceil(shard / STAGING_SEGMENT_BYTES))
    rings = count * _ring(cal, shard / count, m, cal.alpha_inter, cal.beta_inter, cpu, flows=k, network=True)
    if cal.transport == "direct":
        return rings
    segment = shard / count
    return max(rings, shard * cal.pcie) + 2 * segment * cal.pcie


def parse_rate(text: str) -> float:
    """A link rate in bits/s: '56gbit' -> 56e9; also mbit, kbit, or a plain number of bits/s."""
    given, text = text, text.lower().strip()
    number, factor = text, 1.0
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(suffix):
            number, factor = text[: -len(suffix)], scale
            break
    try:
        return float(number) * factor
    except ValueError:
        raise ValueError(f"expected a rate such as 56gbit, 100mbit or bits/s, got {given!r}") from None


def segments(sizes_bytes: list[int], threshold: int) -> list[int]:
    """LazyAllreduce's segments: tensors in push order, fired once at least `threshold` bytes wait."""
    out, pending = [], 0
    for size in sizes_bytes:
        pending += size
        if pending >= threshold:
            out.append(pending)
            pending = 0
    if pending:
        out.append(pending)
    return out


def step_time(
    sizes_bytes: list[int],
    ranks: int,
    compute_s: float,
    *,
    ranks_per_node: int | None = None,
    compression: str | None = None,
    lazy_threshold: int | None = 4 * 2**20,
    density: float | None = None,
    chunk_elems: int = 32768,
    overlap: bool = True,
    algorithm: str = "auto",
    calibration=None,
    local_copies: float = 1.0,
    dtype_bytes: int = 4,
    backward_share: float = BACKWARD_SHARE,
) -> dict:
    """One training step on `ranks` ranks: {'comm_s', 'iteration_s', 'speedup', 'efficiency'}.

    sizes_bytes: the gradients in production order (last layer first: pass them reversed from the
    parameter order). lazy_threshold None: one allreduce per tensor. density: CSC's (None: dense).
    dtype_bytes: the gradients' element size (2: trained in fp16; 8: float64), for CSC's element count
    and the bytes compression sends.
    local_copies: passes of copying over the gradients besides the allreduces (LazyAllreduce's
    flush() copies the results back into the pushed arrays: 1; pushing ordinary arrays adds 1).
    backward_share: the share of compute that communication can hide behind (with overlap)."""
    cal = calibration if isinstance(calibration, Calibration) else Calibration.load(calibration)
    kw = dict(ranks_per_node=ranks_per_node, algorithm=algorithm, calibration=cal)
    groups = segments(sizes_bytes, lazy_threshold) if lazy_threshold else list(sizes_bytes)
    times = []
    for nbytes in groups:
        if density is not None:
            elems = nbytes // dtype_bytes
            k = min(ranks_per_node or ranks, ranks)
            local = _slowdown(cal, k) * cal.csc * elems
            auto = {**kw, "algorithm": "auto"}  # (SparseAllreduce's own allreduces take "auto")
            norms = allreduce_time(4 * max(1, elems // chunk_elems), ranks, **auto)
            packed = allreduce_time(
                int(density * nbytes), ranks, compression=compression, dtype_bytes=dtype_bytes, **auto
            )
            times.append(local + norms + packed)
        else:
            times.append(
                allreduce_time(nbytes, ranks, compression=compression, dtype_bytes=dtype_bytes, **kw)
            )
    k = min(ranks_per_node or ranks, ranks)
    copies = local_copies * _slowdown(cal, k) * cal.copy * sum(sizes_bytes) if ranks > 1 else 0.0
    comm = float(sum(times))
    if overlap and times:  # hidden behind backward, but for the last segment; the copies come after
        iteration = compute_s + max(times[-1], comm - backward_share * compute_s) + copies
    else:
        iteration = compute_s + comm + copies
    comm += copies
    speedup = ranks * compute_s / iteration
    return {"comm_s": comm, "iteration_s": iteration, "speedup": speedup, "efficiency": speedup / ranks}


def workload_sizes(name: str, dtype_bytes: int = 4) -> list[int]:
    """A model's gradient sizes in bytes, in production order (last layer first)."""
    if name not in MODELS:
        raise ValueError(f"workload: expected one of {sorted(MODELS)} or a file of sizes, got {name!r}")
    return [int(np.prod(shape)) * dtype_bytes for shape in reversed(MODELS[name])]


REPEATS = 5  # calibrate measures each ping-pong point this many times and keeps the median


def busier_than_cores(own_ranks: int, cores: int, load=None) -> str | None:
    """Why a calibration taken now would be slower than this machine is, or None: the load besides
    this job's own ranks on the node exceeds the cores (one at load 11 on 2 cores projected AlexNet
    at 17% efficiency instead of 67%). `load`: the tasks that want a core now, this job's included;
    None: looked up (runnable_now(), else the 1-minute load average)."""
    if load is None:
        load = runnable_now()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # (no load average on this platform)
            return None
    others = load - own_ranks
    if others <= cores:
        return None
    return (
        f"the machine is busy: load {load:.1f} on {cores} cores, {others:.1f} of it besides this job's "
        f"{own_ranks} ranks here; the constants measured now will be slower than this machine is "
        "(calibrate on a quiet machine)"
    )


def runnable_now(looks: int = 5) -> float | None:
    """The tasks runnable on this machine now (the fourth field of Linux's /proc/loadavg, the median
    of a few looks), this job's ranks included while they wait in MPI; None where there is none. Not
    the load average, which lags a job started seconds ago by a minute (helper-48: 5.5 tasks besides
    this job's on 2 cores went unnamed)."""
    counts = []
    for _ in range(looks):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]))
        except (OSError, ValueError, IndexError):
            return None
        time.sleep(0.01)
    return float(np.median(counts))


_floored: list = []  # the terms calibrate() measured below what the model can take (_at_least)


def _at_least(name: str, floor: float, value: float) -> float:
    """A measured term, kept at `floor` where the measurement came out below it (noise, or the
    machine's speed changed while measuring): calibrate() then says which terms were floored."""
    if value < floor:
        _floored.append(name)
        return floor
    return value


def _pingpong(comm, a: int, b: int, nbytes: int, reps: int) -> float:
    """One-way seconds of an nbytes message between ranks a and b (others return 0 at once)."""
    from mpi4py import MPI

    if comm.rank not in (a, b):
        return 0.0
    peer = b if comm.rank == a else a
    buf = np.ones(max(nbytes, 1), np.uint8)
    msg = [buf[:nbytes], MPI.BYTE]
    for _ in range(2):
        comm.Sendrecv(msg, peer, 7, buf[:nbytes], peer, 7)
    start = MPI.Wtime()
    for _ in range(reps):
        comm.Sendrecv(msg, peer, 7, buf[:nbytes], peer, 7)
    return (MPI.Wtime() - start) / reps  # both directions at once: one message's time each way


def _fit(sizes, times) -> tuple[float, float]:
    """(alpha, beta) of t = alpha + beta * size: alpha the smallest message's time, beta the slope
    between the two largest (a least-squares line lets the large sizes' noise swamp alpha)."""
    alpha = float(times[0])
    beta = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
    return max(alpha, 1e-7), max(float(beta), 1e-13)


def _local_rate(comm, fn, reps: int) -> float:
    """Seconds per fn() with every rank running it over and over at once: the median of REPEATS
    batches of the slowest rank's mean (a throughput under the node's real contention, not one lucky
    run on a free core, nor one unlucky batch)."""
    from mpi4py import MPI

    fn()
    fn()  # twice: the node phase alternates two slots, each faulted in on first use
    batches = []
    for _ in range(REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(reps):
            fn()
        batches.append(comm.allreduce((MPI.Wtime() - start) / reps, op=MPI.MAX))
    return float(np.median(batches))


def _cores_of(comm, node) -> int:
    """The cores the ranks of this node may run on: the union of their CPU affinities (a job bound to
    2 of 16 cores has 2), else the machine's count. Collective on comm."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    everyone = comm.allgather(mine)
    if any(everyone[r] is None for r in node):
        return os.cpu_count() or 1
    return len(set().union(*(everyone[r] for r in node))) or 1


def calibrate(comm=None, progress=print) -> Calibration:
    """Measure the constants on `comm` (every rank calls it; collective). See the module docstring."""
    from mpi4py import MPI

    import gflow

    from ..arrays import host_ops as host
    from ..arrays.codecs import WIRE_DTYPE, decode, encode
    from ..collectives.topology import discover
    from ..runtime.context import context

    comm = comm or MPI.COMM_WORLD
    _floored.clear()
    topo = discover(comm)
    node = topo.nodes[topo.node_of[comm.rank]]
    k_here = max(len(n) for n in topo.nodes)
    cores = _cores_of(comm, node)
    slow = float(max(1, math.ceil(k_here / cores)))
    cal = Calibration(cores=cores, source=f"gflow calibrate on {comm.size} ranks, {topo.describe()}")
    busy = comm.bcast(busier_than_cores(len(node), cores) if comm.rank == 0 else None, root=0)
    if busy:  # (rank 0's view, so that every rank holds the same calibration)
        progress(f"warning: {busy}")
        cal.source += f" (warning: {busy})"
    sizes = [8, 64 * 2**10, 2**20, 8 * 2**20]

    def pairs_fit(pairs):
        times = []
        for nbytes in sizes:
            reps = 200 if nbytes < 2**20 else 20
            tries = []
            for _ in range(REPEATS):  # each point's median of REPEATS: one noisy burst moves no constant
                mine = 0.0
                for a, b in pairs:
                    mine = max(mine, _pingpong(comm, a, b, nbytes, reps))
                tries.append(comm.allreduce(mine, op=MPI.MAX))
            times.append(float(np.median(tries)))
        return _fit(sizes, times)

    # Inside a node: every node's ranks in pairs, all at once (the load a node phase or ring sees).
    intra = [(n[i], n[i + 1]) for n in topo.nodes for i in range(0, len(n) - 1, 2)]
    if intra:
        alpha, beta = pairs_fit(intra)
        cal.alpha_intra, cal.beta_intra = alpha, beta / slow
        progress(f"inside a node: alpha {alpha * 1e6:.1f} us, {1 / beta / 1e9:.2f} GB/s per pair under load")
    if len(topo.nodes) > 1:  # one flow on each node's link: the nodes in pairs, all at once
        nodes = topo.nodes
        alpha, beta = pairs_fit([(nodes[i][0], nodes[i + 1][0]) for i in range(0, len(nodes) - 1, 2)])
        cal.alpha_inter, cal.beta_inter = alpha, beta
        progress(f"between nodes: alpha {alpha * 1e6:.1f} us, {8 / beta / 1e9:.3f} Gbit/s one flow")
    n = LOCAL_BYTES // 4
    a, b = np.random.default_rng(comm.rank).random((2, n), dtype=np.float32)
    out = np.empty_like(a)
    cal.gamma = _local_rate(comm, lambda: host.reduce(out, a, b, "sum"), 5) / slow / out.nbytes
    cal.copy = _local_rate(comm, lambda: np.copyto(out, a), 5) / slow / out.nbytes
    wire = np.empty(n, WIRE_DTYPE)
    cal.codec = (
        _local_rate(comm, lambda: (encode(host, wire, a, "sum", 1), decode(host, out, wire)), 5) / slow / n
    )
    csc = gflow.SparseAllreduce(density=0.01, chunk_elems=32768, comm=MPI.COMM_SELF)
    cal.csc = _local_rate(comm, lambda: csc(a), 5) / slow / n
    progress(
        f"per core: reduce {1 / cal.gamma / 1e9:.2f} GB/s, copy {1 / cal.copy / 1e9:.2f} GB/s, "
        f"fp16 codec {cal.codec * 1e9:.2f} ns/elem, CSC {cal.csc * 1e9:.2f} ns/elem"
    )
    alpha = cal.alpha_inter if len(topo.nodes) > 1 else cal.alpha_intra
    if comm.size > 1:  # gflow's own cost per ring step, per call, per recursive-doubling round
        *costs, slot_step = _step_costs(comm, alpha)
        cal.py_step, cal.py_call, cal.rd_step = (t / slow for t in costs)
        cal.slot_step = None if slot_step is None else slot_step / slow
    if k_here > 1:  # the node phase, and a ring, on each node alone (every rank: collectives of comm)
        node_comm = comm.Split(topo.node_of[comm.rank], key=comm.rank)  # (nodes as discover found or posed)
        k = k_here  # (the times are the slowest rank's, so the largest node's; a rank alone times copies)
        agree = _agreement(cal, k, cal.alpha_intra, slow, one_host=True)
        times = []
        huge_x = np.random.default_rng(comm.rank).random(HUGE_BYTES // 4, dtype=np.float32)
        huge_out = np.empty_like(huge_x)
        # into `out`, as a trainer's: a new array is page faults
        node_arrays = (a[:k], a, a[: SMALL_BYTES // 4], a[: RING_SCALE_BYTES[0] // 4], huge_x)
        for x in node_arrays:
            y = huge_out if x is huge_x else out
            t = _local_rate(
                node_comm,
                lambda x=x, y=y: gflow.allreduce(
                    x, comm=node_comm, algorithm="hierarchical", out=y[: x.size]
                ),
                10 if x.nbytes < HUGE_BYTES else 3,
            )
            times.append(comm.allreduce(t, op=MPI.MAX))
        cal.node_fixed = _at_least("node_fixed", 1e-6, (times[0] - agree) / slow - cal.py_call)
        passes = (
            ("node_passes", 0.5),
            ("node_passes_small", 0.1),
            ("node_passes_mid", 0.1),
            ("node_passes_huge", 0.1),
        )
        for (name, floor), x, t in zip(
            passes, node_arrays[1:], times[1:], strict=True
        ):  # (past the tiny one)
            setattr(cal, name, _at_least(name, floor, (t - times[0]) / (slow * cal.copy * x.nbytes)))
        # The bytes of an "auto" allreduce reduced in the slots, where the model takes them: one node
        # (alike on every rank), whose ranks share one host (slot_step measured).
        if (
            len(topo.nodes) == 1
            and cal.slot_step is not None
            and context(node_comm).slots
            and SMALL_BYTES + HEADER_BYTES <= slot_room(k)  # (else "auto" takes the ring there)
            and gflow.config.small_message_bytes == DEFAULT_SMALL_MESSAGE_BYTES  # (as the model's dispatch)
            and gflow.config.shared_memory_min_bytes == DEFAULT_SHARED_MEMORY_MIN_BYTES
        ):
            x = a[: SMALL_BYTES // 4]
            t = _local_rate(node_comm, lambda: gflow.allreduce(x, comm=node_comm, out=out[: x.size]), 20)
            t = comm.allreduce(t, op=MPI.MAX)
            latency_path = SMALL_BYTES <= latency_path_limit(k, DEFAULT_SMALL_MESSAGE_BYTES)
            fixed, bandwidth = _slots_parts(cal, SMALL_BYTES, k, latency_path)
            cal.slots_scale = _at_least("slots_scale", 0.05, (t / slow - fixed) / bandwidth)
        scales = []
        names = ("ring_scale_small", "ring_scale", "ring_scale_large", "ring_scale_huge")
        for name, nbytes in zip(names, (SMALL_BYTES, *RING_SCALE_BYTES, HUGE_BYTES), strict=True):
            x, y = (a[: nbytes // 4], out) if nbytes <= a.nbytes else (huge_x, huge_out)
            t = _local_rate(
                node_comm,
                lambda x=x, y=y: gflow.allreduce(x, comm=node_comm, algorithm="ring", out=y[: x.size]),
                40 if nbytes < 2**20 else 10 if nbytes < 2**24 else 4 if nbytes < HUGE_BYTES else 2,
            )
            t = comm.allreduce(t, op=MPI.MAX)
            fixed, bandwidth = _ring_parts(cal, x.nbytes, k, cal.alpha_intra, slow * cal.beta_intra, slow)
            scales.append(_at_least(name, 0.2, (t - slow * cal.py_call - agree - fixed) / bandwidth))
        cal.ring_scale_small, cal.ring_scale, cal.ring_scale_large, cal.ring_scale_huge = scales
        del huge_x, huge_out
        node_comm.Free()
    if len(topo.nodes) == 1 and comm.size > cores > 1:
        cal.uncrowded = _uncrowded(comm, cores)
        progress("one rank per core: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in cal.uncrowded.items()))
    passes = _at_sizes(cal.node_passes_small, cal.node_passes_mid, cal.node_passes, cal.node_passes_huge)
    ring_scales = _at_sizes(cal.ring_scale_small, cal.ring_scale, cal.ring_scale_large, cal.ring_scale_huge)
    progress(
        f"node phase {passes} copies per byte + {cal.node_fixed * 1e6:.0f} us; slots' bytes "
        f"x{cal.slots_scale:.2f}; ring bandwidth x {ring_scales}; "
        f"gflow's own cost per ring step {cal.py_step * 1e6:.2f} us, per call {cal.py_call * 1e6:.1f} us, "
        f"per recursive-doubling round {cal.rd_step * 1e6:.1f} us"
        + (f", per exchange through the slots {cal.slot_step * 1e6:.1f} us" if cal.slot_step else "")
    )
    floored = comm.allgather(sorted(set(_floored)))  # (every rank's: the terms are the slowest rank's)
    floored = sorted({name for names in floored for name in names})
    if floored:
        why = (
            f"{', '.join(floored)} measured below what the model can take, kept at its floor (noise, or the "
            "machine's speed changed while measuring): predictions with them are optimistic; calibrate again"
        )
        progress(f"warning: {why}")
        cal.source += f" (warning: {why})"
    return cal


def device_terms(reps: int = 200) -> dict:
    """The device terms of a calibration, measured on this process's GPU: `launch`, one small kernel
    launched from Python and the stream sync after it (what a ring step or a node-phase kernel pays
    beyond its bytes), and `pcie`, seconds per byte of a pinned copy between host and device (the
    mean of the two directions, 16 MiB each). Each is the median of REPEATS timed batches."""
    from numba import cuda

    from ..cuda import ops as dev

    rng = np.random.default_rng(0)
    a, b = (cuda.to_device(rng.random(256, dtype=np.float32)) for _ in range(2))
    out = cuda.device_array(256, np.float32)

    def launch():
        dev.reduce(out, a, b, "sum")
        dev.fence()

    nbytes = 16 * 2**20
    host = cuda.pinned_array(nbytes, np.uint8)
    host[:] = rng.integers(0, 255, nbytes, dtype=np.uint8)
    device = cuda.device_array(nbytes, np.uint8)

    def both_ways():
        device.copy_to_device(host)
        device.copy_to_host(host)
        cuda.synchronize()

    def per_call(fn, count: int) -> float:
        fn()
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            for _ in range(count):
                fn()
            times.append((time.perf_counter() - start) / count)
        return float(np.median(times))

    name = getattr(cuda.get_current_device(), "name", "Numba's CUDA simulator")
    return {
        "launch": per_call(launch, reps),
        "pcie": per_call(both_ways, max(1, reps // 20)) / (2 * nbytes),
        "device": name.decode() if isinstance(name, bytes) else str(name),
    }


def _step_costs(comm, alpha: float) -> tuple:
    """(py_step, py_call, rd_step, slot_step) on comm, as measured (collective): tiny ring allreduces
    of one element per segment, with 1 and with 33 segments per chunk (their difference over the 32
    more exchanges of each of p - 1 steps is one step's cost; what the one-segment ring costs beyond
    its steps and its agreement is the call's), and a tiny recursive doubling: over MPI's messages
    (a duplicate of comm without the slots) for rd_step, and, where comm's ranks exchange through
    one host's slots, as it goes there for slot_step (else None)."""

    import gflow

    from ..runtime.context import context

    p, rounds = comm.size, rd_round_count(comm.size)
    one, many = np.ones(p, np.float32), np.ones(33 * p, np.float32)
    segment = gflow.config.ring_segment_bytes
    try:
        gflow.config.ring_segment_bytes = 4
        t_one = _local_rate(comm, lambda: gflow.allreduce(one, comm=comm, algorithm="ring"), 100)
        t_many = _local_rate(comm, lambda: gflow.allreduce(many, comm=comm, algorithm="ring"), 100)
    finally:
        gflow.config.ring_segment_bytes = segment
    t_rd = _local_rate(comm, lambda: gflow.allreduce(one, comm=comm), 200)
    slot_step = t_rd if context(comm).slots else None
    if slot_step is not None:  # (rd_step: MPI's rounds, as between hosts)
        apart, shared = comm.Dup(), gflow.config.shared_slots
        try:
            gflow.config.shared_slots = False  # (read by the context's first exchange only)
            gflow.allreduce(one, comm=apart)
        finally:
            gflow.config.shared_slots = shared
        t_rd = _local_rate(apart, lambda: gflow.allreduce(one, comm=apart), 200)
        apart.Free()
    # (not _at_least: with the compiled ring loops, a step costs little beyond its latency, and a value
    # at the floor is what this measures, not a slip)
    py_step = max(1e-8, (t_many - t_one) / (32 * (p - 1)) - alpha)
    rd_step = _at_least("rd_step", 1e-7, t_rd / rounds - alpha)
    py_call = _at_least(
        "py_call",
        1e-7,
        t_one - _measured_agreement(p, alpha, rd_step, slot_step) - 2 * (p - 1) * (alpha + py_step),
    )
    return py_step, py_call, rd_step, slot_step


def _measured_agreement(p: int, alpha: float, rd_step: float, slot_step) -> float:
    """The agreement before a bandwidth algorithm on a communicator of p ranks as calibrate measured
    it: one exchange through the slots where they were measured, else MPI's rounds."""
    return slot_step if slot_step is not None else rd_round_count(p) * (alpha + rd_step)


def python_share(nbytes: int, ranks: int, *, calibration=None, **kwargs) -> float:
    """The share of allreduce_time(nbytes, ranks, **kwargs) that is gflow's own code (py_step,
    py_call, rd_step), the rest being the machine's (latency, bandwidth, reductions)."""
    cal = calibration if isinstance(calibration, Calibration) else Calibration.load(calibration)
    without = replace(cal, **{k: 0.0 for k in _PYTHON_COSTS})
    if cal.uncrowded:
        without.uncrowded = {**cal.uncrowded, **{k: 0.0 for k in _PYTHON_COSTS if k in cal.uncrowded}}
    total = allreduce_time(nbytes, ranks, calibration=cal, **kwargs)
    return 1.0 - allreduce_time(nbytes, ranks, calibration=without, **kwargs) / total if total else 0.0


def _at_sizes(*values) -> str:
    """'1.20 / 0.80 / 0.90 / 1.10 at 512 KiB / 8 / 32 / 128 MB' (a term not measured: '-')."""
    shown = " / ".join("-" if v is None else f"{v:.2f}" for v in values)
    return f"{shown} at 512 KiB / 8 / 32 / 128 MB"


def _uncrowded(comm, cores: int) -> dict:
    """The fixed costs with one rank per core: the first `cores` ranks measure gflow's own tiny
    allreduces (and a ping-pong) while the others wait without spinning. Collective over comm."""
    import time

    from mpi4py import MPI

    import gflow

    busy = comm.rank < cores
    sub = comm.Split(0 if busy else MPI.UNDEFINED, comm.rank)
    result = None
    if busy:
        p = sub.size
        alpha = sub.allreduce(_pingpong(sub, 0, 1, 8, 200), op=MPI.MAX)
        py_step, py_call, rd_step, slot_step = _step_costs(sub, alpha)
        x = np.ones(p, np.float32)
        out = np.empty_like(x)
        t = _local_rate(sub, lambda: gflow.allreduce(x, comm=sub, algorithm="hierarchical", out=out), 20)
        node_fixed = _at_least(
            "node_fixed", 1e-6, t - py_call - _measured_agreement(p, alpha, rd_step, slot_step)
        )
        result = {"alpha_intra": alpha, "py_step": py_step, "py_call": py_call, "rd_step": rd_step,
                  "node_fixed": node_fixed}  # fmt: skip
        if slot_step is not None:
            result["slot_step"] = slot_step
        sub.Free()
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)
    return comm.bcast(result, root=0)


# A V100 node of GradientFlow's cluster, for `python -m gflow model` (stated in the README): per-element
# work on the GPU at HBM2 speeds (900 GB/s peak; a copy moves its bytes twice, a reduction three times),
# NVLink inside the node, and gflow's own Python cost as calibrated (it runs on the host regardless).
# PCIe 3.0 x16 between a V100 and its host: about 12 GB/s each way in practice.
GPU_NODE = {
    "copy": 1 / 400e9, "gamma": 1 / 270e9, "codec": 8 / 400e9, "csc": 12 / 400e9, "intra_Bps": 100e9,
    "pcie_Bps": 12e9,
}  # fmt: skip
V100 = {
    # Derived from GradientFlow's own figures: 95 epochs of ImageNet (1.28M images) in 1.5 minutes on
    # 512 GPUs at a 410.2x speedup is 3,294 img/s on one V100; batch 128 per GPU (64K in all).
    "alexnet": {"batch": 128, "images_per_s": 3294.0},
    # NVIDIA's published V100 mixed-precision ResNet-50 training rate, about 1,000 img/s (order of
    # magnitude: DeepLearningExamples reports 900-1,200 depending on the framework); batch 64 per GPU.
    "resnet50": {"batch": 64, "images_per_s": 1000.0},
}


def cluster(
    base: Calibration,
    link_bits: float,
    latency_s: float,
    ranks_per_node: int,
    gpu: bool = True,
    transport: str = "direct",
):
    """`base` (gflow's Python cost) on a cluster: nodes joined by links of link_bits/s and latency_s,
    each node's ranks with a core each; with gpu, the per-element work at GPU speeds (GPU_NODE), the
    node phase in CUDA IPC peer memory, and device buffers reaching MPI by `transport` ("direct":
    a CUDA-aware MPI; "staged": through pinned host memory over PCIe)."""
    if transport not in ("direct", "staged"):
        raise ValueError(f"transport: expected 'direct' or 'staged', got {transport!r}")
    cal = Calibration(**asdict(base))
    cal.beta_inter, cal.alpha_inter = 8.0 / link_bits, latency_s
    cal.cores = max(cal.cores, ranks_per_node)
    if gpu:
        cal.host_gamma, cal.host_beta_intra = base.gamma, base.beta_intra
        cal.copy, cal.gamma, cal.codec, cal.csc = (GPU_NODE[k] for k in ("copy", "gamma", "codec", "csc"))
        # (the host's caches: not device memory's)
        cal.node_passes_small = cal.node_passes_mid = cal.node_passes_huge = None
        cal.ring_scale_small = cal.ring_scale_huge = None
        cal.beta_intra, cal.alpha_intra = 1 / GPU_NODE["intra_Bps"], 5e-6
        cal.transport = transport
        if not base.device:  # (measured by `calibrate --device`: kept)
            cal.pcie = 1 / GPU_NODE["pcie_Bps"]
        if cal.uncrowded:  # (the node's latency is the cluster's now, not the calibrating CPU's)
            cal.uncrowded = {k: v for k, v in cal.uncrowded.items() if k != "alpha_intra"}
    cal.source = f"{base.source}; cluster: {link_bits / 1e9:g} Gbit/s, {latency_s * 1e6:g} us between nodes"
    if gpu:
        cal.source += f"; device buffers {transport}"
    return cal


TECHNIQUES = [
    # name, algorithm, compression, lazy threshold, CSC density (None: dense), overlap
    ("per-tensor ring, fp32, no overlap", "ring", None, None, None, False),
    ("lazy flat ring, fp32", "ring", None, 4 * 2**20, None, True),
    ("lazy hierarchical, fp32", "hierarchical", None, 4 * 2**20, None, True),
    ("lazy flat ring, fp16", "ring", "fp16", 4 * 2**20, None, True),
    ("lazy hierarchical, fp16", "hierarchical", "fp16", 4 * 2**20, None, True),
    ("lazy hierarchical, fp16 + CSC", "hierarchical", "fp16", 4 * 2**20, "density", True),
]


def predict(
    sizes_bytes,
    ranks,
    ranks_per_node,
    compute_s,
    batch,
    cal,
    density=0.01,
    techniques=TECHNIQUES,
    backward_share=BACKWARD_SHARE,
):
    """Rows of the model's table: each technique's step at `ranks`."""
    rows = []
    for name, algorithm, compression, threshold, csc, overlap in techniques:
        wire, dtype_bytes = sizes_bytes, 4
        if compression == "fp16":  # compute in fp16: the gradients are fp16 already, no codec pass
            wire, compression, dtype_bytes = [s // 2 for s in sizes_bytes], None, 2
        step = step_time(
            wire,
            ranks,
            compute_s,
            ranks_per_node=ranks_per_node,
            compression=compression,
            lazy_threshold=threshold,
            dtype_bytes=dtype_bytes,
            density=density if csc else None,
            overlap=overlap,
            algorithm=algorithm,
            calibration=cal,
            backward_share=backward_share,
        )
        step["images_per_s"] = ranks * batch / step["iteration_s"]
        rows.append({"technique": name + (f" {density:g}" if csc else ""), **step})
    return rows
