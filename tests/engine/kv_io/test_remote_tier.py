"""The remote tier shared by replicas, on a real redis-server: one engine's work serves another's
prompts token-exact, and no fault of the store (killed, slow, full, bad values) fails a request
or changes an output; every bad value is a miss counted by its reason."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from engine import LLM, SamplingParams
from engine.kv.hashing import extra_keys, hash_blocks
from engine.kv_io.remote_format import decode, encode
from engine.kv_io.tier_setup import TPShare, disk_manifest, remote_tag
from tests.support.prompts import rand_tokens
from tests.support.redis_proc import RedisProcess
from tests.support.thread_proxy import ThreadDelayProxy

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_llm(path: Path, url: str | None, **cfg: Any) -> LLM:
    cfg.setdefault("num_device_blocks", 256)
    cfg.setdefault("num_cpu_blocks", 16)
    return LLM(str(path), dtype="float32", block_size=BS, kv_remote=url, **cfg)


def remote_stats(llm: LLM) -> Any:
    return next(t for t in llm.engine.get_stats().tiers if t.name == "remote")


def flush(llm: LLM) -> None:
    offload = llm.engine.core.offload
    assert offload is not None and offload.flush(10.0)


def tokens(llm: LLM, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, **kw)]


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> Iterator[LLM]:
    """Caching off: the expected outputs."""
    yield make_llm(tiny_llama_path, None, num_cpu_blocks=0, enable_prefix_caching=False)


@pytest.mark.parametrize(
    "b_cfg",
    [
        {},
        {"max_num_batched_tokens": 48},  # chunked prefill over remote hits
        {"num_device_blocks": 24, "max_num_seqs": 4},  # preemption while loading
    ],
    ids=["plain", "chunked", "preempt"],
)
def test_another_engine_is_served_from_the_remote_tier(
    tiny_llama_path: Path, reference: LLM, redis_proc: RedisProcess, b_cfg: dict[str, Any]
) -> None:
    prompts = [rand_tokens(200, seed) for seed in range(3)]
    want = tokens(reference, prompts)
    a = make_llm(tiny_llama_path, redis_proc.url)
    assert tokens(a, prompts) == want
    flush(a)
    b = make_llm(tiny_llama_path, redis_proc.url, **b_cfg)
    outs = b.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    for o in outs:
        # every full block but the one holding the last prompt token: 12 of 200 tokens' blocks
        assert o.cached_tokens.remote == 12 * BS, o.cached_tokens
    s = remote_stats(b)
    assert s.hits == 3 * 12 * BS and s.swap_ins >= 3 * 12 and not s.misses
    assert remote_stats(a).write_errors == 0


def test_tenants_do_not_share_remote_blocks(
    tiny_llama_path: Path, reference: LLM, redis_proc: RedisProcess
) -> None:
    prompt = rand_tokens(120, 7)
    a = make_llm(tiny_llama_path, redis_proc.url)
    tokens(a, [prompt], cache_salt="tenant-a")
    flush(a)
    b = make_llm(tiny_llama_path, redis_proc.url)
    other = b.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    same = b.generate([rand_tokens(40, 8) + prompt[40:]], GREEDY, cache_salt="tenant-a")[0]
    assert other.cached_tokens.remote == 0
    assert same.cached_tokens.remote == 0  # another prefix: the chain differs from block 0
    again = b.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert again.cached_tokens.remote == 7 * BS
    assert again.outputs[0].token_ids == tokens(reference, [prompt])[0]


def test_fp8_cache_is_shared(tiny_llama_path: Path, redis_proc: RedisProcess) -> None:
    prompts = [rand_tokens(150, 20 + i) for i in range(2)]
    ref = make_llm(
        tiny_llama_path, None, num_cpu_blocks=0, enable_prefix_caching=False,
        kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    want = tokens(ref, prompts)
    a = make_llm(tiny_llama_path, redis_proc.url, kv_cache_dtype="fp8_e4m3")
    assert tokens(a, prompts) == want
    flush(a)
    b = make_llm(tiny_llama_path, redis_proc.url, kv_cache_dtype="fp8_e4m3")
    outs = b.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.cached_tokens.remote == 9 * BS for o in outs)
    # a bf16/float32 engine never reads the fp8 values (its keys and tag differ)
    c = make_llm(tiny_llama_path, redis_proc.url)
    assert all(o.cached_tokens.remote == 0 for o in c.generate(prompts, GREEDY))


def get(r: redis.Redis, name: str) -> bytes:
    value = r.get(name)
    assert isinstance(value, bytes), name
    return value


def _keys(llm: LLM, prompt: list[int], salt: str | None = None) -> list[str]:
    extra = extra_keys(llm.engine.model_info.model_id, salt)
    offload = llm.engine.core.offload
    assert offload is not None and offload.remote is not None
    return [offload.remote.key(h) for h in hash_blocks(prompt, BS, extra)]


def test_bad_values_are_misses_with_their_reason(
    tiny_llama_path: Path, reference: LLM, redis_proc: RedisProcess
) -> None:
    """Truncated, bit-flipped, another model's (another layout tag), another tenant's and a
    tensor-parallel share's value under a block's key: each a miss at that block, counted by its
    reason, and the output unchanged."""
    prompts = [rand_tokens(200, 100 + i) for i in range(5)]
    want = tokens(reference, prompts)
    a = make_llm(tiny_llama_path, redis_proc.url)
    tokens(a, prompts)
    other_tenant = rand_tokens(200, 200)
    tokens(a, [other_tenant], cache_salt="someone-else")
    flush(a)
    r = redis.Redis.from_url(redis_proc.url)
    offload = a.engine.core.offload
    assert offload is not None and offload.remote is not None
    tag = offload.remote.tag
    keys = [_keys(a, p) for p in prompts]
    bad_at = 5  # blocks 0..4 stay good: each prompt gets exactly 5 remote blocks
    value = get(r, keys[0][bad_at])
    r.set(keys[0][bad_at], value[:-100])  # truncated
    flipped = bytearray(get(r, keys[1][bad_at]))
    flipped[len(flipped) // 2] ^= 0x10
    r.set(keys[1][bad_at], bytes(flipped))  # corrupt payload
    payload = torch.frombuffer(bytearray(value[128:]), dtype=torch.uint8)
    block = hash_blocks(prompts[2], BS, extra_keys(a.engine.model_info.model_id))[bad_at]
    r.set(keys[2][bad_at], encode(block, payload, bytes(16)))  # another model's tag
    tenant_value = get(r, _keys(a, other_tenant, "someone-else")[bad_at])
    r.set(keys[3][bad_at], tenant_value)  # another tenant's block under this key
    eng = a.engine
    manifest = disk_manifest(eng.model_info, eng.core._fingerprint(), torch.float32, None)
    assert remote_tag(manifest, None) == tag
    tp_tag = remote_tag(manifest, TPShare(rank=0, world=2, first_kv_head=0, kv_heads=1))
    block4 = hash_blocks(prompts[4], BS, extra_keys(eng.model_info.model_id))[bad_at]
    r.set(keys[4][bad_at], encode(block4, payload, tp_tag))  # another tensor-parallel layout

    b = make_llm(tiny_llama_path, redis_proc.url)
    outs = b.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.cached_tokens.remote for o in outs] == [bad_at * BS] * 5
    assert remote_stats(b).misses == {
        "truncated": 1, "checksum": 1, "foreign": 2, "other_block": 1,
    }  # fmt: skip
    # the bad values were deleted, and b's recompute wrote good ones in their place
    flush(b)
    for i in range(5):
        block = hash_blocks(prompts[i], BS, extra_keys(eng.model_info.model_id))[bad_at]
        decode(get(r, keys[i][bad_at]), block, len(value) - 128, tag)


def test_a_killed_store_fails_no_request_and_is_used_again(
    tiny_llama_path: Path, reference: LLM, redis_proc: RedisProcess
) -> None:
    prompts = [rand_tokens(100, 300 + i) for i in range(4)]
    want = tokens(reference, prompts)
    a = make_llm(tiny_llama_path, redis_proc.url, kv_remote_retry_s=0.5, kv_remote_timeout_s=0.5)
    assert tokens(a, prompts[:2]) == want[:2]
    flush(a)  # a write failing first would mark it down, and the lookups below would not fail
    redis_proc.stop()
    t0 = time.monotonic()
    assert tokens(a, prompts[2:]) == want[2:]  # lookups and writes fail: recompute
    assert time.monotonic() - t0 < 5.0
    s = remote_stats(a)
    assert s.disabled == 1 and s.misses.get("error", 0) >= 1
    redis_proc.start()
    time.sleep(0.6)
    fresh = rand_tokens(100, 310)
    assert tokens(a, [fresh]) == tokens(reference, [fresh])  # a writes again
    flush(a)
    b = make_llm(tiny_llama_path, redis_proc.url)
    out = b.generate([fresh], GREEDY)[0]
    assert out.cached_tokens.remote == 6 * BS
    assert remote_stats(a).disabled == 0


def test_a_slow_store_costs_hits_not_requests(
    tiny_llama_path: Path, reference: LLM, redis_proc: RedisProcess
) -> None:
    prompts = [rand_tokens(100, 400 + i) for i in range(3)]
    want = tokens(reference, prompts)
    a = make_llm(tiny_llama_path, redis_proc.url)
    tokens(a, prompts)
    flush(a)
    proxy = ThreadDelayProxy(redis_proc.port, delay_s=0.6)
    try:
        b = make_llm(tiny_llama_path, proxy.url, kv_remote_timeout_s=0.3, kv_remote_retry_s=30.0)
        t0 = time.monotonic()
        outs = b.generate(prompts, GREEDY)
        assert time.monotonic() - t0 < 5.0
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.cached_tokens.remote == 0 for o in outs)
        s = remote_stats(b)
        assert s.disabled == 1 and s.misses["error"] == 1  # then left alone for retry_s
    finally:
        proxy.close()


def test_a_full_store_drops_writes_and_fails_nothing(
    tiny_llama_path: Path, reference: LLM, tmp_path: Path
) -> None:
    proc = RedisProcess(extra=("--maxmemory-policy", "noeviction"))
    proc.start()
    try:
        r = redis.Redis.from_url(proc.url)
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", used + 200_000)  # room for ~20 of the ~72 blocks
        prompts = [rand_tokens(300, 500 + i) for i in range(4)]
        want = tokens(reference, prompts)
        a = make_llm(tiny_llama_path, proc.url)
        assert tokens(a, prompts) == want
        flush(a)
        s = remote_stats(a)
        assert s.dropped_writes > 0 and s.write_errors == 0
        b = make_llm(tiny_llama_path, proc.url)
        assert tokens(b, prompts) == want
    finally:
        proc.stop()
