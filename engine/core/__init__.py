"""The engine core: the step loop and what it decides (vLLM V1's `EngineCore` and `v1/core/sched`).

engine_core.py       `EngineCore`: executor + KV cache manager + scheduler + outputs, one step at a time
core_loop.py         `CoreLoop`: the busy loop, over an in-process channel or pipes (transport.py)
messages.py          the typed messages between the front end and the core
core_process.py      the engine-core process's entry point
scheduler.py         continuous batching: token budget, chunked prefill, preemption; a step's update
step_update.py       what a step's output does to requests and sequences
step_records.py      the scheduler's decision as the workers' plain record
sequence.py          request and sequence state
output_processor.py  every sample's output state: stop checks, stream deltas
detokenizer.py       incremental detokenization with stop strings
step_rates.py        measured step costs, published for the router's cost policy
spec/                speculative decoding's proposals: prompt lookup, per-tenant suffix corpus
"""
