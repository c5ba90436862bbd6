"""The remote tier under tensor parallelism (two gloo ranks): each rank writes its share of every
block (its KV heads; 2 and 1 of 3 here) under its own layout tag, rank 0's lookup reads and
checks every share, and a block is a hit only with all of them. Another engine with N = 2 is
served token-exact; a share one rank lost is a miss from that block on; N = 1 never reads the
N = 2 values (another tag)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from engine import LLM, SamplingParams
from engine.kv.hashing import extra_keys, hash_blocks
from engine.testing.tiny_models import build_tiny_llama
from tests.support.prompts import rand_tokens
from tests.support.redis_proc import RedisProcess

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_llm(path: Path, **cfg: Any) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, num_device_blocks=256, **cfg)


def test_remote_tier_per_rank_shares(tmp_path: Path, redis_proc: RedisProcess) -> None:
    path = build_tiny_llama(
        tmp_path / "m", hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    url = redis_proc.url
    reference = make_llm(path, num_cpu_blocks=0, enable_prefix_caching=False)
    prefix = rand_tokens(512, 1)
    first, second = prefix + rand_tokens(20, 2), prefix + rand_tokens(30, 3)
    expected = [o.token_ids for o in reference.generate([first, second], GREEDY)]

    a = make_llm(path, tensor_parallel_size=2, num_cpu_blocks=16, kv_remote=url)
    assert a.generate([first], GREEDY)[0].token_ids == expected[0]
    assert a.engine.close(timeout_s=30.0)  # every rank's writes sent
    r = redis.Redis.from_url(url)
    keys = sorted(k.decode() for k in r.scan_iter("deja:kv:*"))
    tags = sorted({k.split(":")[2] for k in keys})
    assert len(tags) == 2 and len(keys) == 2 * ((512 + 20) // BS)  # one share per rank
    sizes = sorted({r.strlen(k) for k in keys})
    assert len(sizes) == 2  # rank 0 holds 2 KV heads, rank 1 one

    b = make_llm(path, tensor_parallel_size=2, num_cpu_blocks=16, kv_remote=url)
    out = b.generate([second], GREEDY)[0]
    assert out.token_ids == expected[1]
    assert out.cached_tokens.remote == 512
    assert b.engine.close(timeout_s=30.0)

    # rank 1's share of block 10 is gone: from there on the prefix is a miss
    hashes = hash_blocks(second, BS, extra_keys(b.engine.model_info.model_id))
    small = [k for k in keys if r.strlen(k) == sizes[0]]
    rank1_tag = small[0].split(":")[2]
    assert r.delete(f"deja:kv:{rank1_tag}:{hashes[10].hex()}") == 1
    c = make_llm(path, tensor_parallel_size=2, num_cpu_blocks=16, kv_remote=url)
    third = prefix + rand_tokens(10, 4)
    out = c.generate([third], GREEDY)[0]
    assert out.token_ids == reference.generate([third], GREEDY)[0].token_ids
    assert out.cached_tokens.remote == 10 * BS
    assert c.engine.close(timeout_s=30.0)

    one = make_llm(path, num_cpu_blocks=16, kv_remote=url)
    out = one.generate([prefix + rand_tokens(10, 5)], GREEDY)[0]
    assert out.cached_tokens.remote == 0
