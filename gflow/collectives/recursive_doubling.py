"""Recursive doubling with an agreement header: the latency path, and the check that ranks agree.

Every message is one byte buffer, [header | payload]. The header carries the sender's call signature
(gflow/_validate.py) or, once a disagreement has been seen, the record of the first two ranks found to
disagree. Merging two headers is a reduction like the payload's, so after the log2(p) rounds every rank
holds the same verdict: all agree, or "rank a called X, rank b called Y". Then every rank raises, or
none does. Nobody hangs on a mismatch: all ranks run the same schedule whatever they were called with,
and every receive has room for the largest message a peer may send (header + small_message_bytes).

Used two ways:
- with the data as payload, for messages up to small_message_bytes: the check rides along for free;
- header only, before the ring, for larger messages: log2(p) tiny messages.

Schedule (p2 = largest power of two <= p, rem = p - p2): ranks below 2*rem pair up, the even one sends
its buffer to the odd one and drops out; the p2 survivors exchange with rank ^ 2^k in round k; at the
end the odd ranks hand the result back to their even partner. Latency: log2(p2) + 2 steps when p is
not a power of two. Each rank sends N bytes per round: the right choice only while N is small.
The lower-ranked operand always goes first, so every rank computes bitwise the same result.
"""

import numpy as np
from mpi4py import MPI

from .._context import TAG_AGREE, CommContext
from .._validate import SIG_LEN, describe
from ..errors import GflowError, MismatchError

_MAGIC = 0x67666C6F77  # "gflow"
_OK, _MISMATCH = 0, 1
# header words: magic, state, rank_a, sig_a[SIG_LEN], rank_b, sig_b[SIG_LEN]
_A = slice(2, 3 + SIG_LEN)
_B = slice(3 + SIG_LEN, 4 + 2 * SIG_LEN)
HEADER_WORDS = 4 + 2 * SIG_LEN
HEADER_BYTES = HEADER_WORDS * 8
_SIG_BYTES = slice(3 * 8, (3 + SIG_LEN) * 8)  # the sig_a part, as bytes


def _merge(mine: np.ndarray, theirs: np.ndarray, mine_is_lower: bool) -> bool:
    """Fold `theirs` into `mine` (int64 headers). Return True when both were OK and agree."""
    low, high = (mine, theirs) if mine_is_lower else (theirs, mine)
    if theirs[0] != _MAGIC:
        # Not a gflow header at all: record it against the sender with an all-zero signature.
        mine[1] = _MISMATCH
        mine[_B] = 0
        mine[_B.start] = -1
        return False
    if low[1] == _OK and high[1] == _OK:
        if np.array_equal(low[3 : 3 + SIG_LEN], high[3 : 3 + SIG_LEN]):
            mine[2] = low[2]
            return True
        record = np.concatenate([low[_A], high[_A]])
    elif low[1] == _MISMATCH and high[1] == _MISMATCH:
        record = min(low[2:], high[2:], key=lambda r: (r[0], r[1 + SIG_LEN]))
    else:
        record = (low if low[1] == _MISMATCH else high)[2:]
    mine[1] = _MISMATCH
    mine[2:] = record
    return False


def _exchange(ctx: CommContext, send, recv, peer: int, mode: str):
    """One message: Sendrecv, or half of it. Returns False if the peer's message did not fit."""
    try:
        if mode == "sendrecv":
            ctx.comm.Sendrecv([send, MPI.BYTE], peer, TAG_AGREE, [recv, MPI.BYTE], peer, TAG_AGREE)
        elif mode == "send":
            ctx.comm.Send([send, MPI.BYTE], peer, TAG_AGREE)
        else:
            ctx.comm.Recv([recv, MPI.BYTE], peer, TAG_AGREE)
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_TRUNCATE:
            raise GflowError(f"MPI failed during the agreement exchange with rank {peer}: {exc}") from exc
        return False
    return True


def _oversized(header: np.ndarray, peer: int) -> None:
    """Record that `peer` sent more than any agreeing rank would (a rank with other settings)."""
    if header[1] == _OK:
        header[1] = _MISMATCH
        header[_B] = 0
        header[_B.start] = peer


def allreduce_with_agreement(ctx: CommContext, sig, ops, capacity: int, src=None, dst=None, op=None):
    """Check that every rank passed the same `sig`; allreduce the flat `src` into `dst` on the way.

    With src None only the signatures travel. op is "sum", "max" or "min". `capacity` is the largest
    payload in bytes any rank may send (config.small_message_bytes): receives are sized for it.
    Raises MismatchError on every rank when any two ranks' signatures differ.
    """
    payload = src
    nbytes = 0 if payload is None else payload.nbytes
    if nbytes > capacity:
        raise ValueError(f"payload of {nbytes} bytes exceeds the agreement capacity of {capacity} bytes")
    send = ctx.scratch("rd_send", HEADER_BYTES + capacity, ops)
    recv = ctx.scratch("rd_recv", HEADER_BYTES + capacity, ops)
    mine = send[:HEADER_BYTES].view(np.int64)
    theirs = recv[:HEADER_BYTES].view(np.int64)
    mine[:] = 0
    mine[0] = _MAGIC
    mine[1] = _OK
    mine[2] = ctx.rank
    mine[3 : 3 + SIG_LEN] = sig
    message = send[: HEADER_BYTES + nbytes]
    acc = recv_payload = None
    if payload is not None:
        acc = send[HEADER_BYTES : HEADER_BYTES + nbytes].view(payload.dtype)
        recv_payload = recv[HEADER_BYTES : HEADER_BYTES + nbytes].view(payload.dtype)
        ops.copy(acc, payload)

    fold = ctx.rd_fold
    if fold is not None and fold[0] == "send":
        _exchange(ctx, message, None, fold[1], "send")
        if _exchange(ctx, None, recv, fold[1], "recv"):
            # The final verdict and result computed by the partner: take both as they are.
            send[: HEADER_BYTES + nbytes] = recv[: HEADER_BYTES + nbytes]
        else:
            _oversized(mine, fold[1])
    else:
        steps = ctx.rd_rounds if fold is None else [(fold[1], True)] + ctx.rd_rounds
        for i, (peer, peer_is_lower) in enumerate(steps):
            mode = "recv" if (fold is not None and i == 0) else "sendrecv"
            if not _exchange(ctx, message, recv, peer, mode):
                _oversized(mine, peer)
            elif _merge(mine, theirs, not peer_is_lower) and acc is not None:
                if peer_is_lower:
                    ops.reduce(acc, recv_payload, acc, op)
                else:
                    ops.reduce(acc, acc, recv_payload, op)
        if fold is not None:
            _exchange(ctx, message, None, fold[1], "send")

    if mine[1] != _OK:
        raise MismatchError(_mismatch_message(mine))
    if payload is not None:
        ops.copy(dst, acc)


def _mismatch_message(header: np.ndarray) -> str:
    rank_a, sig_a = int(header[_A][0]), header[_A][1:]
    rank_b, sig_b = int(header[_B][0]), header[_B][1:]
    first = f"rank {rank_a} {describe(sig_a)}"
    if rank_b < 0 or not sig_b.any():
        who = "a peer" if rank_b < 0 else f"rank {rank_b}"
        second = f"{who} sent a message this protocol does not accept (different gflow settings or version?)"
    else:
        second = f"rank {rank_b} {describe(sig_b)}"
    return f"ranks disagree: {first}; {second}"
