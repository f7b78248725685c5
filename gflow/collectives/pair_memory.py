"""Two ranks on one host exchange the agreement's messages through shared memory instead of MPI.

At p = 2 a recursive-doubling exchange is one message each way, and MPI's point-to-point path is
most of its time: MPICH's own Allreduce of 256 B took 7.8 us here, gflow's exchange over MPI a few
more, and the same exchange through a shared slot 2.4 us (bench/pair_exchange.py; bench/RESULTS.md,
"Two ranks through shared memory"). So a two-rank context whose ranks share a host carries the
header's message (the header and a payload up to recursive_doubling.PAIR_INLINE_BYTES, 2 MiB: all
the latency path carries at p = 2 by default) in slots of a shared file; larger payloads still go
apart over MPI. The latency path writes its payload into the slot straight from the caller's array
and folds the peer's from where it lies, and from a plan's second use it does the whole exchange in
one compiled call (native_loops.pair_step): one copy in, none out, where MPI copies in and out.

Every exchange of such a context goes this way (the latency path, the agreement before a bandwidth
algorithm, join()'s), so two ranks whose calls differ still pair message for message and raise.

Slots: each rank writes into its own, two of them used alternately: the message, its length, then
its sequence number, last. The peer reads a slot once it sees the number it expects. A rank writes
a slot again two exchanges later, which it cannot begin before the peer has begun the one between,
so the peer has read it by then (and folded it: a message is read in place until the reader posts
again). This relies on stores becoming visible in program order: x86-64 (elsewhere the context
keeps MPI); the compiled exchange publishes the number with a release store, so the compiler keeps
that order too.

Set-up (connect): once per context, after its first exchange that succeeded on both ranks alike,
over MPI in watched waits. The lower rank makes an anonymous memory file (memfd_create) holding a
random token and sends its process id and descriptor; the other opens it through /proc, checks the
token and answers. No name is ever made, so nothing is left behind whichever rank dies when: the
memory goes with the last mapping. The file holds four slots (8 MiB per two-rank communicator),
reserved when it is made. Either rank saying no (GFLOW_PAIR_MEMORY=0, another host, no memfd or no
room for it, /proc not open to it) keeps MPI for that context, on both ranks.
"""

import mmap
import os
import platform
import secrets

import numpy as np

from ..runtime.config import config
from ..runtime.context import TAG_PAIR, CommContext

DATA_AT = 64  # per slot: [sequence number, length], padded to a cache line, then the message
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


class PairSlots:
    """The two ranks' slots in one mapping, seen from one rank."""

    def __init__(self, mapping: mmap.mmap, rank: int, room: int):
        self.mapping = mapping
        stride = _stride(room)
        memory = np.frombuffer(mapping, np.uint8, count=4 * stride).reshape(2, 2, stride)
        self.memory = memory  # (the compiled exchange's view: native_loops.pair_step)
        # memoryviews: their item reads, writes and copies cost half of NumPy's, per call
        words = [[memoryview(memory[r, k, :16]).cast("q") for k in (0, 1)] for r in (0, 1)]
        data = [[memoryview(memory[r, k, DATA_AT:]) for k in (0, 1)] for r in (0, 1)]
        self._my_words, self._their_words = words[rank], words[1 - rank]
        self._my_data, self._their_data = data[rank], data[1 - rank]
        self.sequence = 0  # this rank's messages posted so far

    def post(self, *parts) -> None:
        """Write this rank's next message (bytes-likes of bytes, one after another, at most the room
        together) and publish it."""
        self.sequence += 1
        k = self.sequence & 1
        data, n = self._my_data[k], 0
        for part in parts:
            m = len(part)
            data[n : n + m] = part
            n += m
        words = self._my_words[k]
        words[1] = n
        words[0] = self.sequence  # last: the peer reads nothing before it sees this

    def arrived(self) -> bool:
        """Whether the peer's message of this exchange is in its slot."""
        return self._their_words[self.sequence & 1][0] == self.sequence

    def wait(self, ctx: CommContext) -> memoryview:
        """Wait (watched, as ctx waits) for the peer's message of this exchange; the message where it
        lies, in the peer's slot. It stays there, unchanged, until this rank posts again: the peer
        writes that slot next two exchanges later."""
        if not self.arrived():
            ctx.wait_until(self.arrived)
        k = self.sequence & 1
        return self._their_data[k][: self._their_words[k][1]]

    def receive(self, ctx: CommContext, room) -> int:
        """wait, then copy the message into room (a memoryview of bytes); its length."""
        message = self.wait(ctx)
        n = len(message)
        room[:n] = message
        return n

    def close(self) -> None:
        for views in (self._my_words, self._their_words, self._my_data, self._their_data):
            for view in views:
                view.release()
        try:
            self.mapping.close()
        except BufferError:  # (a NumPy view of it is still alive: the mapping goes with it)
            pass


def _stride(room: int) -> int:
    return -(-(DATA_AT + room) // 64) * 64


def wanted(ctx: CommContext) -> bool:
    """Whether ctx is one whose ranks try to connect (alike on both: size and platform)."""
    return ctx.size == 2 and _ORDERED_STORES


def connect(ctx: CommContext, room: int):
    """PairSlots for ctx's two ranks, or None where either cannot or will not (both ranks return
    alike). Collective over ctx: both ranks call it at the same point of their calls."""
    peer, size = 1 - ctx.rank, 4 * _stride(room)
    willing = bool(config.pair_memory) and hasattr(os, "memfd_create")
    offer = np.zeros(4, np.int64)  # [willing, token, process id, file descriptor]
    theirs = np.zeros_like(offer)
    mapping, fd = None, -1
    if ctx.rank == 0 and willing:
        try:
            fd = os.memfd_create("gflow-pair")
            os.posix_fallocate(fd, 0, size + 8)  # (ENOSPC here, not SIGBUS on a write later)
            mapping = mmap.mmap(fd, size + 8)
            token = secrets.randbits(62)
            np.frombuffer(mapping, np.int64, count=1, offset=size)[0] = token
            offer[1:] = token, os.getpid(), fd
        except OSError:
            willing = False
    offer[0] = willing
    answer = np.zeros(1, np.int64)  # the other rank's: it opened the file and found the token
    try:
        ctx.sendrecv(offer, peer, TAG_PAIR, theirs, peer, TAG_PAIR)
        if ctx.rank == 1:
            if willing and theirs[0]:
                try:
                    with open(f"/proc/{int(theirs[2])}/fd/{int(theirs[3])}", "r+b") as file:
                        mapping = mmap.mmap(file.fileno(), size + 8)
                    if np.frombuffer(mapping, np.int64, count=1, offset=size)[0] == theirs[1]:
                        answer[0] = 1
                except (OSError, ValueError):
                    pass
            ctx.sendrecv(answer, peer, TAG_PAIR, np.zeros(1, np.int64), peer, TAG_PAIR)
        else:
            ctx.sendrecv(np.zeros(1, np.int64), peer, TAG_PAIR, answer, peer, TAG_PAIR)
    finally:
        if fd >= 0:  # (once the peer has opened its own: the mappings keep the memory)
            os.close(fd)
    if not answer[0]:
        if mapping is not None:
            mapping.close()
        return None
    return PairSlots(mapping, ctx.rank, room)
