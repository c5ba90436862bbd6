"""The disk tier under tensor parallelism (two gloo ranks): each rank writes its own share of
every block (its KV heads; 2 and 1 of 3 here, so the shares differ in size) into its own
folder, `<disk_dir>/tp2-rank<r>`. A restart with N = 2 serves the prefix from disk token-exact;
a block one rank lost is a miss, not a wrong load; a restart with N = 1 on the same directory
is a clean miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.kv.hashing import extra_keys, hash_blocks
from engine.testing.tiny_models import build_tiny_llama
from tests.support.prompts import rand_tokens

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_llm(path: Path, **cfg: Any) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, num_device_blocks=256, **cfg)


def files(d: Path) -> list[Path]:
    return sorted(d.glob("??/*.kv"))


def test_disk_tier_per_rank_restart_same_and_other_size(tmp_path: Path) -> None:
    path = build_tiny_llama(
        tmp_path / "m", hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    disk = tmp_path / "disk"
    reference = make_llm(path, num_cpu_blocks=0, enable_prefix_caching=False)
    prefix = rand_tokens(1024, 1)
    first, second = prefix + rand_tokens(20, 2), prefix + rand_tokens(30, 3)
    expected = [o.token_ids for o in reference.generate([first, second], GREEDY)]

    llm = make_llm(path, tensor_parallel_size=2, num_cpu_blocks=16, disk_dir=str(disk))
    assert llm.generate([first], GREEDY)[0].token_ids == expected[0]
    assert llm.engine.close(timeout_s=30.0)
    ranks = [disk / "tp2-rank0", disk / "tp2-rank1"]
    written = [files(r) for r in ranks]
    assert [len(w) for w in written] == [(1024 + 20) // BS] * 2
    assert [f.name for f in written[0]] == [f.name for f in written[1]]  # the same blocks
    sizes = [w[0].stat().st_size for w in written]
    assert sizes[0] > sizes[1]  # rank 0 holds 2 KV heads, rank 1 one
    assert not files(disk)  # nothing at the top level: that is N = 1's folder

    llm2 = make_llm(path, tensor_parallel_size=2, num_cpu_blocks=16, disk_dir=str(disk))
    out = llm2.generate([second], GREEDY)[0]
    assert out.token_ids == expected[1]
    assert out.cached_tokens.disk >= 0.98 * 1024
    assert llm2.engine.close(timeout_s=30.0)

    # rank 1 loses its share of one block of the prefix: from there on the prefix is a miss
    lost = 10
    hashes = hash_blocks(second, BS, extra_keys(llm2.engine.model_info.model_id))
    (ranks[1] / hashes[lost].hex()[:2] / f"{hashes[lost].hex()}.kv").unlink()
    llm3 = make_llm(path, tensor_parallel_size=2, num_cpu_blocks=16, disk_dir=str(disk))
    out = llm3.generate([second], GREEDY)[0]
    assert out.token_ids == expected[1]
    assert out.cached_tokens.disk == lost * BS
    assert llm3.engine.close(timeout_s=30.0)

    one = make_llm(path, num_cpu_blocks=16, disk_dir=str(disk))
    out = one.generate([second], GREEDY)[0]
    assert out.token_ids == expected[1]
    assert out.cached_tokens.disk == 0  # another N: a clean miss
    assert one.engine.close(timeout_s=30.0)
    assert files(disk)  # N = 1 wrote its own files at the top level
