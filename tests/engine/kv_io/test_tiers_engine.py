"""The tiers in the engine: identical greedy output, CPU and disk hits, restart, corruption, pins,
swap preemption. Every test ends with every device block free and both pools intact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.frontend.llm_engine import LLMEngine
from engine.kv.hashing import hash_blocks
from engine.outputs import RequestOutput
from engine.worker.step_record import StepRecord
from tests.support.prompts import rand_tokens

BS = 16
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(path: Path, **cfg: Any) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, **cfg)


def count_computed(llm: LLM) -> list[int]:
    """Wraps the runner so that box[0] counts the tokens each step computes."""
    box = [0]
    runner = llm.engine.core.runner
    launch = runner.launch

    def counted(sched: StepRecord, *args: Any) -> Any:
        box[0] += sched.num_tokens
        return launch(sched, *args)

    runner.launch = counted  # type: ignore[method-assign,assignment]
    return box


def all_free(eng: LLMEngine) -> None:
    eng.core.kv.check_integrity()
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks, "device blocks leaked"
    assert not eng.core.requests
    if eng.core.tiers is not None:
        eng.core.tiers.check_integrity()
        assert not eng.core.tiers.swapped
        assert all(b.ref_cnt == 0 for b in eng.core.tiers.cpu.blocks) or eng.core.tiers.pins


def close(llm: LLM) -> None:
    all_free(llm.engine)
    if llm.engine.core.offload is not None:
        llm.engine.core.offload.close()


def tier(eng: LLMEngine, name: str) -> Any:
    return next(t for t in eng.get_stats().tiers if t.name == name)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def gen(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> Iterator[LLM]:
    """A pool that holds everything and no lower tiers: the expected outputs."""
    llm = make_llm(tiny_llama_path, num_device_blocks=1024, num_cpu_blocks=0)
    yield llm
    close(llm)


def sessions(num: int, turns: int) -> list[list[list[int]]]:
    """Per session, its prompts turn by turn: each turn extends the last one."""
    out = []
    for s in range(num):
        prompt: list[int] = rand_tokens(64, 1000)  # a shared system prompt
        turns_s = []
        for t in range(turns):
            prompt = prompt + rand_tokens(40 + 7 * t, 100 * s + t)
            turns_s.append(list(prompt))
        out.append(turns_s)
    return out


@pytest.mark.parametrize("policy", ["write-back", "write-through", "selective"])
def test_outputs_identical_with_a_quarter_pool_through_cpu_and_disk(
    tiny_llama_path: Path, reference: LLM, tmp_path: Path, policy: str
) -> None:
    work = sessions(8, 3)
    # Working set: 8 sessions of up to 64 + 40 + 47 + 54 = 205 prompt tokens + 6 generated,
    # 14 blocks each: 112 blocks. The device pool holds a quarter of it.
    device_blocks = 28
    llm = make_llm(
        tiny_llama_path,
        num_device_blocks=device_blocks,
        num_cpu_blocks=24,
        disk_dir=str(tmp_path / "disk"),
        disk_write_policy=policy,
        max_num_seqs=2,
    )
    for turn in range(3):
        prompts = [s[turn] for s in work]
        expected = tokens(reference.generate(prompts, GREEDY))
        assert tokens(gen(llm, prompts, GREEDY)) == expected, f"turn {turn}"
        all_free(llm.engine)
    eng = llm.engine
    assert eng.core.tiers is not None
    c = eng.core.tiers.counters
    assert c.device_spills > 0 and c.cpu_swap_ins > 0
    if policy == "write-through":  # every block went to disk once, when computed
        assert c.disk_writes > 0 and c.disk_stores == 0 and c.disk_loads > 0
    elif policy == "selective":
        # hit twice: the 4 blocks of the shared system prompt, and at most the 2 own full
        # blocks of each session's first turn (hit by turns 2 and 3); nothing else
        assert 64 // BS <= c.disk_writes + c.disk_stores <= 64 // BS + 8 * 2
    else:
        assert c.disk_stores > 0 and c.disk_loads > 0, "blocks went device -> CPU -> disk and back"
    cpu, disk = tier(eng, "cpu"), tier(eng, "disk")
    assert cpu.hits > 0 and (disk.hits > 0 or policy == "selective")
    assert cpu.swap_ins == c.cpu_swap_ins and disk.swap_ins == c.disk_loads
    assert (
        cpu.bytes_moved == (c.device_spills + c.cpu_swap_ins + c.disk_stores) * eng.core.block_bytes
    )
    assert disk.dropped_writes == 0 and disk.disabled == 0
    close(llm)


def test_cpu_tier_serves_a_prefix_larger_than_the_pool_allows(
    tiny_llama_path: Path, reference: LLM
) -> None:
    prefix = rand_tokens(1024, 7)
    # 72 device blocks: one 1,024-token prompt (64 blocks) plus its suffix and output fit, but
    # not the prefix plus the traffic in between.
    llm = make_llm(tiny_llama_path, num_device_blocks=72, num_cpu_blocks=256)
    computed = count_computed(llm)
    first = prefix + rand_tokens(20, 8)
    assert tokens(gen(llm, [first], GREEDY)) == tokens(reference.generate([first], GREEDY))
    for i in range(2):  # traffic that needs the whole pool
        gen(llm, [rand_tokens(1000, 20 + i)], GREEDY)
    assert llm.engine.core.kv.match_prefix(_seq_like(llm, [*prefix, 1])).num_tokens == 1024
    second = prefix + rand_tokens(30, 9)
    before = computed[0]
    out = gen(llm, [second], GREEDY)[0]
    assert out.token_ids == reference.generate([second], GREEDY)[0].token_ids
    ct = out.cached_tokens
    assert ct.cpu > 0 and ct.device + ct.cpu == 1024 and ct.disk == 0
    # No recomputation of the spilled prefix: only the 30 new tokens and the decode steps.
    assert computed[0] - before == len(second) - 1024 + MAX_TOKENS - 1
    assert tier(llm.engine, "cpu").hits == ct.cpu
    close(llm)


def _seq_like(llm: LLM, token_ids: list[int]) -> Any:
    """What match_prefix reads of a sequence with these tokens (no request is queued)."""
    from tests.engine.kv.test_manager import FakeSeq

    seq = FakeSeq(-1, token_ids)
    seq.block_hashes = hash_blocks(token_ids, BS, _extra(llm))
    return seq


def _extra(llm: LLM) -> bytes:
    from engine.kv.hashing import extra_keys

    return extra_keys(llm.engine.model_info.model_id)


def _disk_llm(tiny_llama_path: Path, disk_dir: Path) -> LLM:
    """A 48-block engine with a 40-block CPU tier and a disk tier at `disk_dir`."""
    return make_llm(
        tiny_llama_path, num_device_blocks=48, num_cpu_blocks=40, disk_dir=str(disk_dir)
    )


def _fill_disk(tiny_llama_path: Path, disk_dir: Path, seed: int, reference: LLM) -> list[int]:
    """Computes a random 512-token prefix in one engine, pushes it through the CPU tier to disk
    and returns it."""
    prefix = rand_tokens(512, seed)
    llm = _disk_llm(tiny_llama_path, disk_dir)
    first = prefix + rand_tokens(10, 1)
    assert tokens(gen(llm, [first], GREEDY)) == tokens(reference.generate([first], GREEDY))
    for i in range(3):
        gen(llm, [rand_tokens(700, 50 + i)], GREEDY)
    assert llm.engine.core.offload is not None
    llm.engine.core.offload.flush()
    close(llm)
    return prefix


def test_restart_serves_the_prefix_from_disk(
    tiny_llama_path: Path, reference: LLM, tmp_path: Path
) -> None:
    prefix = _fill_disk(tiny_llama_path, tmp_path, 11, reference)
    llm = _disk_llm(tiny_llama_path, tmp_path)
    computed = count_computed(llm)
    prompt = prefix + rand_tokens(25, 12)
    out = gen(llm, [prompt], GREEDY)[0]
    assert out.token_ids == reference.generate([prompt], GREEDY)[0].token_ids
    assert out.cached_tokens.disk == 512 and out.cached_tokens.device == out.cached_tokens.cpu == 0
    assert computed[0] == 25 + MAX_TOKENS - 1
    assert tier(llm.engine, "disk").hits == 512
    close(llm)


def test_corrupt_disk_block_is_a_clean_miss(
    tiny_llama_path: Path, reference: LLM, tmp_path: Path
) -> None:
    prefix = _fill_disk(tiny_llama_path, tmp_path, 13, reference)
    hashes = hash_blocks(prefix, BS, _extra(reference))
    bad = tmp_path / hashes[10].hex()[:2] / (hashes[10].hex() + ".kv")
    data = bytearray(bad.read_bytes())
    for i in range(200, 260):  # flip payload bytes
        data[i] ^= 0x5A
    bad.write_bytes(bytes(data))
    llm = _disk_llm(tiny_llama_path, tmp_path)
    prompt = prefix + rand_tokens(25, 14)
    out = gen(llm, [prompt], GREEDY)[0]
    assert out.token_ids == reference.generate([prompt], GREEDY)[0].token_ids
    assert out.cached_tokens.disk == 10 * BS  # the hits stop at the bad block
    store = llm.engine.core.offload
    assert store is not None and store.disk is not None
    assert store.disk.num_bad == 1
    store.flush()  # write-through wrote the recomputed block again, whole
    assert not bad.exists() or bad.read_bytes() != bytes(data)
    close(llm)


def test_mismatched_disk_dir_is_ignored(
    tiny_llama_path: Path, tiny_qwen2_path: Path, tmp_path: Path
) -> None:
    llm = make_llm(tiny_llama_path, num_device_blocks=64, num_cpu_blocks=8, disk_dir=str(tmp_path))
    assert llm.engine.core.tiers is not None and llm.engine.core.tiers.disk is not None
    close(llm)
    other = make_llm(
        tiny_qwen2_path, num_device_blocks=64, num_cpu_blocks=8, disk_dir=str(tmp_path)
    )
    assert other.engine.core.tiers is not None and other.engine.core.tiers.disk is None
    prompt = rand_tokens(100, 15)
    assert len(gen(other, [prompt], GREEDY)[0].token_ids) == GREEDY.max_tokens
    close(other)


def test_pinned_prefix_survives_pressure_until_ttl(tiny_llama_path: Path, reference: LLM) -> None:
    prefix = rand_tokens(256, 16)  # 16 blocks
    llm = make_llm(
        tiny_llama_path, num_device_blocks=48, num_cpu_blocks=64, max_pinned_fraction=0.5
    )
    eng = llm.engine
    pinned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, pin_ttl_s=60)
    out = gen(llm, [[*prefix, 5]], pinned)[0]
    assert out.pinned is True
    assert eng.get_stats().tiers[0].pinned_blocks == 16
    gen(llm, [rand_tokens(480, 17)], GREEDY)  # needs every unpinned block
    hit = gen(llm, [prefix + rand_tokens(8, 18)], GREEDY)[0]
    assert hit.cached_tokens.device == 256, "pinned blocks stayed on the device"
    # The TTL passes (what step() does with a later clock).
    later = time.monotonic() + 61
    eng.core.kv.expire_pins(later)
    assert eng.core.tiers is not None
    eng.core.tiers.expire_pins(later)
    assert eng.get_stats().tiers[0].pinned_blocks == 0
    gen(llm, [rand_tokens(700, 19)], GREEDY)  # now the prefix may go (to the CPU tier)
    prompt = prefix + rand_tokens(8, 20)
    after = gen(llm, [prompt], GREEDY)[0]
    assert after.cached_tokens.device < 256 and after.cached_tokens.cpu > 0
    assert after.token_ids == reference.generate([prompt], GREEDY)[0].token_ids
    close(llm)


def test_pin_over_the_cap_is_served_unpinned(tiny_llama_path: Path) -> None:
    llm = make_llm(
        tiny_llama_path, num_device_blocks=48, num_cpu_blocks=64, max_pinned_fraction=0.1
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, pin_ttl_s=60)
    out = gen(llm, [rand_tokens(256, 21)], params)[0]  # 16 blocks > 4 allowed
    assert out.pinned is False and len(out.token_ids) == 3
    assert llm.engine.get_stats().tiers[0].pinned_blocks == 0
    close(llm)


def test_cpu_pins_keep_a_prefix_served_from_cpu(tiny_llama_path: Path) -> None:
    prefix = rand_tokens(128, 22)  # 8 blocks
    llm = make_llm(
        tiny_llama_path, num_device_blocks=48, num_cpu_blocks=40, max_pinned_fraction=0.5
    )
    gen(llm, [[*prefix, 3]], GREEDY)
    gen(llm, [rand_tokens(700, 23)], GREEDY)  # the prefix goes to the CPU tier
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, pin_ttl_s=60)
    out = gen(llm, [[*prefix, 4]], params)[0]
    assert out.pinned is True and out.cached_tokens.cpu > 0
    eng = llm.engine
    assert eng.core.tiers is not None
    assert tier(eng, "cpu").pinned_blocks == out.cached_tokens.cpu // BS
    # The blocks served from the CPU tier are pinned there (the others only on the device).
    in_cpu = [h for h in eng.core.tiers.pins if eng.core.tiers.cpu.lookup(h) is not None]
    assert len(in_cpu) == out.cached_tokens.cpu // BS
    for i in range(3):  # traffic through the CPU tier (fits beside the pinned blocks)
        gen(llm, [rand_tokens(500, 24 + i)], GREEDY)
    assert eng.core.tiers.cpu.num_evictions > 0
    assert all(eng.core.tiers.cpu.lookup(h) is not None for h in in_cpu)
    eng.core.kv.expire_pins(float("inf"))
    eng.core.tiers.expire_pins(float("inf"))
    close(llm)


@pytest.mark.parametrize("cpu_blocks", [512, 8])
def test_swap_preemption_matches_recompute(
    tiny_llama_path: Path, reference: LLM, cpu_blocks: int
) -> None:
    prompts = [rand_tokens(100 + 37 * i, 30 + i) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = tokens(reference.generate(prompts, params))
    # 40 blocks cannot hold 8 running sequences of up to 375 tokens: preemption.
    cfg = dict(num_device_blocks=40, num_cpu_blocks=cpu_blocks, max_num_batched_tokens=128)
    recompute = make_llm(tiny_llama_path, **cfg)
    assert tokens(recompute.generate(prompts, params)) == expected
    assert recompute.engine.core.scheduler.num_preemptions > 0
    close(recompute)
    swap = make_llm(tiny_llama_path, preemption_mode="swap", **cfg)
    assert tokens(swap.generate(prompts, params)) == expected
    eng = swap.engine
    assert eng.core.scheduler.num_preemptions > 0 and eng.core.tiers is not None
    if cpu_blocks == 512:
        assert (
            eng.core.tiers.counters.swap_outs > 0
            and eng.core.tiers.counters.swapped_tail_tokens > 0
        )
    else:  # too small to take most sequences: falls back to recompute
        assert eng.core.tiers.counters.swap_outs < eng.core.scheduler.num_preemptions
    close(swap)


def test_tiers_off(tiny_llama_path: Path, tmp_path: Path) -> None:
    off = make_llm(tiny_llama_path, num_device_blocks=64, cpu_swap_gib=0)
    assert off.engine.core.tiers is None and [t.name for t in off.engine.get_stats().tiers] == [
        "device"
    ]
    close(off)
    with pytest.raises(ValueError, match="disk tier"):
        make_llm(tiny_llama_path, num_device_blocks=64, num_cpu_blocks=0, disk_dir=str(tmp_path))
    default = make_llm(tiny_llama_path, num_device_blocks=64)
    names = [t.name for t in default.engine.get_stats().tiers]
    assert names == ["device", "cpu"]  # CPU tier on by default, disk off without a directory
    close(default)
