"""The worker: one rank's device, model shard and KV cache; runs each step (vLLM V1's `v1/worker`).

worker.py        `Worker`: the same class on every rank (rank 0 in the engine core's process)
step_record.py   what the core hands the worker each step, as plain data
seq_state.py     the worker's own state of each sequence
model_runner.py  builds the step's flat batch, carries out the KV plan, runs the model and sampler
model_loader.py  reads a local Hugging Face checkpoint folder: config, weights, tokenizer
models/          one file per model family
attention/       attention backends behind one interface (torch reference, CuPy kernels)
parallel/        tensor parallelism: the group, ranks 1..N-1's process and its messages
"""
