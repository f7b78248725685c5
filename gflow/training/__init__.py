"""Training loops' parts, framework-neutral: DataParallel (data_parallel.py) and LossScaler
(loss_scaler.py). Built on gflow/fusion/; gflow/torch/ builds on them."""
