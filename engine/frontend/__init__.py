"""The engine's front end: what runs in the caller's process (vLLM V1's `v1/engine`).

llm.py              the offline API, `LLM(model=...).generate(...)`
llm_engine.py       `LLMEngine`: the engine core plus tokenization, stepped by the caller
async_engine.py     `AsyncEngine`: an LLMEngine stepped by a background thread; callers stream
core_client.py      `EngineCoreClient`: the same interface over an engine core in its own process
base.py             what the two asyncio front ends share (`EngineFrontend`, `read_outputs`)
input_processor.py  prompt + sampling parameters -> a validated, tokenized `Request`
prompt.py           a prompt's token ids and block-hash chain (the rule the router shares)
"""
