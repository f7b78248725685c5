"""What runs beside training: the command line (cli.py, `python -m gflow`), the benchmark
(benchmark.py), and the cost model with its workloads (cost_model.py, workloads.py). The top layer:
nothing in the library imports it."""
