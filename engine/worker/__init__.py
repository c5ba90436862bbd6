"""The worker: runs a step's forward pass on the device (vLLM V1's `v1/worker`).

model_runner.py  builds the step's flat batch, carries out the KV plan, runs the model and sampler
model_loader.py  reads a local Hugging Face checkpoint folder: config, weights, tokenizer
models/          one file per model family
attention/       attention backends behind one interface (torch reference, CuPy kernels)
"""
