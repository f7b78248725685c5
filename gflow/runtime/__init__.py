"""What every collective runs on: settings (config.py), the wire signature ranks agree on
(signature.py), per-communicator state (context.py), the background thread (engine.py), the stall
inspector (stall.py), departed ranks (failures.py), the timeline, checkpoint headers (checkpoint.py),
the MPI library in words (mpi.py) and the exit order (lifecycle.py). Imports nothing above it."""
