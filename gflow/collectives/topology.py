"""Which ranks share a node, and the communicators the hierarchical allreduce runs on.

A node is a set of ranks that share memory. MPI says which ranks those are
(Comm.Split_type(COMM_TYPE_SHARED)); GFLOW_RANKS_PER_NODE=k says instead that consecutive ranks
of the communicator form nodes of k (the last node may have fewer), which lets one machine pose as
several nodes for tests and benchmarks, or names the nodes where MPI cannot see them. Nodes are
numbered by their lowest rank.

Shards. The hierarchical allreduce cuts the flat buffer into S shards, S = the largest node's rank
count, as np.array_split cuts it. In a node of k ranks, local rank j owns the contiguous block of
shards [j*S//k, (j+1)*S//k): one shard each in a full node, more on the ranks of a smaller one. Shard
s's cross-node group holds, on each node, the rank that owns s; the allreduce across nodes is a ring
in each group.

Finding the topology is collective, so it is done where every rank is known to be at the same call:
after the agreement of the first allreduce that needs it (ranks that disagree about the setting then
fail together, see discover), and cached on the context.
"""

from dataclasses import dataclass

from mpi4py import MPI

from ..errors import MismatchError
from ..runtime.config import config

SETTING = "GFLOW_RANKS_PER_NODE"


@dataclass(frozen=True)
class Topology:
    """The nodes of one communicator: each a tuple of its ranks, in node order."""

    nodes: tuple
    source: str  # where the nodes came from, as `gflow info` prints it
    shared_memory: bool  # every node's ranks can map one shared-memory window

    @property
    def node_of(self) -> dict:
        return {rank: n for n, ranks in enumerate(self.nodes) for rank in ranks}

    @property
    def shards(self) -> int:
        return max(len(ranks) for ranks in self.nodes)

    def describe(self) -> str:
        sizes = [len(ranks) for ranks in self.nodes]
        shape = f"{sizes[0]} ranks each" if len(set(sizes)) == 1 else "ranks " + "+".join(map(str, sizes))
        memory = "" if self.shared_memory else "; no shared memory inside a node"
        return f"{len(self.nodes)} node(s) of {shape} (from {self.source}{memory})"


def parse_setting(value) -> int:
    """GFLOW_RANKS_PER_NODE's value (a string or an int) as a count (0: unset, ask MPI); ValueError
    when it is not a positive integer."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return 0
    try:
        k = int(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        k = 0
    if isinstance(value, bool) or k < 1 or (isinstance(value, float) and value != k):
        raise ValueError(f"{SETTING} must be a positive integer number of ranks per node, got {value!r}")
    return k


def discover(comm: MPI.Intracomm, setting=None) -> Topology:
    """The topology of `comm` (collective: every rank of comm calls it at the same point).

    Raises MismatchError on every rank when the ranks hold different settings ("2", " 2" and 2 are
    the same), naming two of them; ValueError on every rank when they all hold the same malformed
    one."""
    setting = config.ranks_per_node if setting is None else setting
    try:
        mine, error = parse_setting(setting), None
    except ValueError as exc:
        mine, error = None, str(exc)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        members = MPI.Group.Translate_ranks(shared.Get_group(), list(range(shared.size)), comm.Get_group())
    finally:
        shared.Free()
    everyone = comm.allgather((mine, error, _shown(setting), tuple(members)))
    verdicts = [(k, err) for k, err, _, _ in everyone]
    if len(set(verdicts)) > 1:
        b = next(r for r, v in enumerate(verdicts) if v != verdicts[0])
        raise MismatchError(
            f"ranks disagree about the topology: rank 0 has {everyone[0][2]}, rank {b} has "
            f"{everyone[b][2]}; set {SETTING} alike on every rank (or on none)"
        )
    if error is not None:
        raise ValueError(error)
    k = mine
    if k:
        nodes = tuple(tuple(range(lo, min(lo + k, comm.size))) for lo in range(0, comm.size, k))
        shared_with = [set(m) for *_, m in everyone]
        can_share = all(set(node) <= shared_with[node[0]] for node in nodes)
        return Topology(nodes, f"{SETTING}={k}", can_share)
    by_leader = {}
    for rank, (*_, group) in enumerate(everyone):
        by_leader.setdefault(min(group), []).append(rank)
    nodes = tuple(tuple(by_leader[leader]) for leader in sorted(by_leader))
    return Topology(nodes, "MPI shared-memory communicators", True)


def _shown(setting) -> str:
    unset = setting is None or (isinstance(setting, str) and not setting.strip())
    return f"{SETTING} unset" if unset else f"{SETTING}={setting!r}"


def shard_block(j: int, k: int, shards: int) -> tuple[int, int]:
    """The shards [first, last) that local rank j of a node of k ranks owns."""
    return j * shards // k, (j + 1) * shards // k
