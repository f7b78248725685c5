"""The collective algorithms: recursive doubling (latency path and argument agreement) and the ring."""
