"""One model step: the batch's flat inputs (batch.py), the runner that calls the model
(runner.py), sampling (sampling.py), the pooled step of embedding requests
(pooling_step.py), and the decode paths chosen once per engine: gates
(feature_gates.py), decode tables (decode_tables.py), CUDA graphs (cuda_graphs.py)
and compiled layer steps (compile_paths.py)."""
