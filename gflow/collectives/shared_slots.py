"""The ranks of a communicator that all share one host exchange the agreement's messages through
shared memory instead of MPI.

At p = 2 a recursive-doubling exchange is one message each way, and MPI's point-to-point path is
most of its time: MPICH's own Allreduce of 256 B took 7.8 us here, gflow's exchange over MPI a few
more, and the same exchange through a shared slot 2.4 us (bench/pair_exchange.py; bench/RESULTS.md,
"Two ranks through shared memory"). At p = 3 and 4, log2(p) rounds of MPI messages become one
step: every rank posts [header | payload] in its slot, waits for every other rank's, and folds all
payloads in rank order from where they lie, so every rank holds the same bits (bench/node_exchange.py:
2.4-4.4x MPICH's Allreduce up to 16 KB; bench/RESULTS.md, "Every rank of one host through one window").
recursive_doubling.py decides what a slot carries (slot_room: from three ranks, payloads up to 2 MiB,
which they reduce a share per rank in two exchanges past 512 KiB over the ranks) and what goes
apart, and reads the slots; native_loops.slots_step and slots_scatter_step are the same exchanges in
one compiled call. The slots of one context span two slots per rank: 8 MiB at p = 2, 16 MiB at
p = 4, at most recursive_doubling.SLOTS_MEMORY_BYTES from there on; of that, what the latency path
writes is reserved when they are made (8 MiB at p = 2, 1 MiB at p = 4), the rest as it is written.

Every exchange of such a context goes this way (the latency path, the agreement before a bandwidth
algorithm, join()'s), so ranks whose calls differ still meet message for message and raise.

Slots: each rank writes into its own, two of them used alternately: the message, its length, then
its sequence number, last. The others read a slot once they see the number they expect. A rank
writes a slot again two exchanges later, which it cannot begin before every other rank has begun
the one between, so each has read it by then (and folded it: a message is read in place until the
reader posts again). This relies on stores becoming visible in program order: x86-64 (elsewhere the
context keeps MPI); the compiled exchange publishes the number with a release store, so the
compiler keeps that order too.

Set-up (connect): once per context, in its first exchange, before it (recursive_doubling's
connect_slots), collective over MPI in watched waits. The ranks first check that they are all on one
host (a hash of its name and boot id, compared by an allreduce), so a communicator across hosts
allocates nothing, and that MPI holds them on one node too (ranks it keeps apart on one host, an
emulated cluster's, talk over its network). Rank 0 then makes an anonymous memory file
(memfd_create) holding a random token and broadcasts its process id and descriptor; every other rank
opens it through /proc, checks the token, and an allreduce combines the answers. No name is ever
made, so nothing is left behind whichever rank dies when: the memory goes with the last mapping.
What the latency path writes is reserved when it is made (connect).
Any rank saying no (GFLOW_SHARED_SLOTS=0, another host or MPI node, no memfd or no room for it,
/proc not open to it) keeps MPI for that context, on every rank.
"""

import hashlib
import mmap
import os
import platform
import secrets
import socket

import numpy as np
from mpi4py import MPI

from ..runtime.config import config
from ..runtime.context import CommContext

DATA_AT = 64  # per slot: [sequence number, length], padded to a cache line, then the message
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


class SharedSlots:
    """Every rank's two slots in one mapping, seen from one rank."""

    def __init__(self, mapping: mmap.mmap, rank: int, size: int, room: int):
        self.mapping, self.rank, self.size, self.room = mapping, rank, size, room
        stride = _stride(room)
        memory = np.frombuffer(mapping, np.uint8, count=2 * size * stride).reshape(size, 2, stride)
        self.memory = memory  # (the compiled exchange's view: native_loops.slots_step)
        # memoryviews: their item reads, writes and copies cost half of NumPy's, per call
        self._words = [[memoryview(memory[r, k, :16]).cast("q") for k in (0, 1)] for r in range(size)]
        self._data = [[memoryview(memory[r, k, DATA_AT:]) for k in (0, 1)] for r in range(size)]
        self._others = [r for r in range(size) if r != rank]
        self.sequence = 0  # this rank's messages posted so far

    def post(self, *parts) -> None:
        """Write this rank's next message (bytes-likes of bytes, one after another, at most the room
        together) and publish it."""
        data, n = self.next_message(), 0
        for part in parts:
            m = len(part)
            data[n : n + m] = part
            n += m
        self.publish(n)

    def next_message(self) -> memoryview:
        """This rank's slot of its next exchange (room bytes), for a message written in place before
        publish(): the others read it no more once this rank has seen all of the current exchange."""
        return self._data[self.rank][(self.sequence + 1) & 1]

    def publish(self, n: int) -> None:
        """Publish the n bytes written into next_message() as this rank's next message."""
        self.sequence += 1
        words = self._words[self.rank][self.sequence & 1]
        words[1] = n
        words[0] = self.sequence  # last: the others read nothing before they see this

    def arrived(self) -> bool:
        """Whether every other rank's message of this exchange is in its slot."""
        sequence, k, words = self.sequence, self.sequence & 1, self._words
        return all(words[r][k][0] == sequence for r in self._others)

    def wait(self, ctx: CommContext) -> list:
        """Wait (watched, as ctx waits) for every other rank's message of this exchange; every rank's
        message (this rank's too) where it lies, in rank order. They stay there, unchanged, until
        this rank posts again: no rank writes that slot before its next exchange but one."""
        if not self.arrived():
            ctx.wait_until(self.arrived)
        k = self.sequence & 1
        return [self._data[r][k][: self._words[r][k][1]] for r in range(self.size)]

    def receive(self, ctx: CommContext, room) -> int:
        """At two ranks: wait, then copy the peer's message into room (a memoryview of bytes); its
        length."""
        message = self.wait(ctx)[1 - self.rank]
        n = len(message)
        room[:n] = message
        return n

    def close(self) -> None:
        for views in (*self._words, *self._data):
            for view in views:
                view.release()
        try:
            self.mapping.close()
        except BufferError:  # (a NumPy view of it is still alive: the mapping goes with it)
            pass


def _stride(room: int) -> int:
    return -(-(DATA_AT + room) // 64) * 64


def wanted(ctx: CommContext) -> bool:
    """Whether ctx is one whose ranks try to connect (alike on all: size and platform)."""
    return ctx.size >= 2 and _ORDERED_STORES


def _host_id() -> int:
    """This host's name and boot, hashed to 56 bits: alike on the ranks of one host, else almost
    surely not (the token check decides; this only spares a communicator across hosts the file)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as file:
            boot = file.read()
    except OSError:
        boot = b""
    digest = hashlib.blake2b(socket.gethostname().encode() + boot, digest_size=7).digest()
    return int.from_bytes(digest, "little")


def _one_mpi_node(comm) -> bool:
    """Whether MPI, too, holds every rank of comm on one node (Split_type; alike on every rank). Ranks
    it keeps apart on one host (an emulated cluster's network namespaces, bench/netem.py; MPICH's
    MPIR_CVAR_NOLOCAL) talk over MPI's network: the slots would bypass it. Collective, and blocking
    (MPI has no nonblocking Split_type): called right after the watched allreduce that every rank
    of comm has entered, as topology.discover calls it."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return shared.size == comm.size
    finally:
        shared.Free()


def connect(ctx: CommContext, room: int, reserved: int):
    """SharedSlots for ctx's ranks, each slot with room for a message of `room` bytes, or None where
    any rank cannot or will not (every rank returns alike). The first `reserved` bytes of each slot's
    message are reserved now (the latency path's: ENOSPC here, not SIGBUS on a write later); the
    rest takes the kernel's pages as it is first written, as any array does, so that a context whose
    calls are small holds little (two MiB-sized slots per rank of every communicator, reserved, took
    16 MiB each at p = 4). Collective over ctx: every rank calls it at the same point of its calls,
    with the same room."""
    comm, stride = ctx.comm, _stride(room)
    size = 2 * ctx.size * stride
    willing = bool(config.shared_slots) and hasattr(os, "memfd_create")
    host = _host_id()
    # [willing, host, -host] at their minimum: all willing, and all on one host where host == --host
    agreed = np.array([willing, host, -host], np.int64)
    ctx.waitall([comm.Iallreduce(MPI.IN_PLACE, [agreed, MPI.INT64_T], op=MPI.MIN)])
    if not agreed[0] or agreed[1] != -agreed[2] or not _one_mpi_node(comm):
        return None
    offer = np.zeros(4, np.int64)  # rank 0's: [able, token, process id, file descriptor]
    mapping, fd = None, -1
    try:
        if ctx.rank == 0:
            try:
                fd = os.memfd_create("gflow-slots")
                os.ftruncate(fd, size + 8)
                for start in range(0, size, stride):
                    os.posix_fallocate(fd, start, min(stride, DATA_AT + reserved))
                os.posix_fallocate(fd, size, 8)
                mapping = mmap.mmap(fd, size + 8)
                token = secrets.randbits(62)
                np.frombuffer(mapping, np.int64, count=1, offset=size)[0] = token
                offer[:] = 1, token, os.getpid(), fd
            except OSError:
                pass
        ctx.waitall([comm.Ibcast([offer, MPI.INT64_T], root=0)])
        answer = np.array([offer[0]], np.int64)  # every rank's: it opened the file and found the token
        if ctx.rank != 0 and offer[0]:
            answer[0] = 0
            try:
                with open(f"/proc/{int(offer[2])}/fd/{int(offer[3])}", "r+b") as file:
                    mapping = mmap.mmap(file.fileno(), size + 8)
                if np.frombuffer(mapping, np.int64, count=1, offset=size)[0] == offer[1]:
                    answer[0] = 1
            except (OSError, ValueError):
                pass
        ctx.waitall([comm.Iallreduce(MPI.IN_PLACE, [answer, MPI.INT64_T], op=MPI.MIN)])
    finally:
        if fd >= 0:  # (once every rank has opened its own: the mappings keep the memory)
            os.close(fd)
    if not answer[0]:
        if mapping is not None:
            mapping.close()
        return None
    return SharedSlots(mapping, ctx.rank, ctx.size, room)
