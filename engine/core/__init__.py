"""The engine core: the step loop and what it decides (vLLM V1's `EngineCore` and `v1/core/sched`).

engine_core.py       `EngineCore`: scheduler + KV cache manager + model runner, one step at a time
core_process.py      `EngineCoreProc`: an EngineCore driven over pipes in a process of its own
scheduler.py         continuous batching: token budget, chunked prefill, preemption
sequence.py          request and sequence state
output_processor.py  stop checks, incremental detokenization, stream deltas (run in the core)
detokenizer.py       incremental detokenization with stop strings
step_rates.py        measured step costs, published for the router's cost policy
"""
