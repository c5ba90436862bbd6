"""The engine's front end: what runs in the caller's process (vLLM V1's `v1/engine`).

llm.py              the offline API, `LLM(model=...).generate(...)`
llm_engine.py       `LLMEngine`: an EngineCore stepped by the caller, with tokenization and text
engine_client.py    `EngineClient`: streams requests through a core that runs its own loop
async_engine.py     `AsyncEngine`: that loop in a thread of this process
core_client.py      `EngineCoreClient`: that loop in a process of its own
base.py             `read_outputs`: one request's stream of deltas
input_processor.py  prompt + sampling parameters -> a validated, tokenized `Request`
output_text.py      the text of the core's token deltas
prompt.py           a prompt's token ids and block-hash chain (the rule the router shares)
"""
