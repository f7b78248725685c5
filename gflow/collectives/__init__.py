"""The collective algorithms and the public operations: recursive doubling (latency path and argument
agreement), the ring, topology and the hierarchical two-level allreduce; dispatch.py owns every
algorithm choice; operations.py holds allreduce (blocking, async, Adasum) and the agreement/reject
path, exchange.py reduce_scatter, alltoall, allgather and broadcast. Built on gflow/arrays/ and
gflow/runtime/."""
