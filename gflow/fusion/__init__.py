"""Many gradients, one step: LazyAllreduce's fusion (lazy.py), its segment strategies and the public
hook (strategies.py), the shared-memory gradient pool (pool.py), the threshold autotuner
(autotune.py) and coarse-grained sparse communication (sparse.py). Built on gflow/collectives/."""
