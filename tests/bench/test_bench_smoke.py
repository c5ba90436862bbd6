"""Both benchmarks run end to end in --quick mode on the tiny random Llama and print their ratios."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench import common, kv_dtype, moe, offline, peer, prefix, quant, spec, step
from engine.testing.tiny_gguf import write_gguf


def _run_quick(
    module: ModuleType, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[str, dict[str, Any]]:
    """Runs a benchmark module with --quick on `model`; returns what it printed and its JSON."""
    out_json = tmp_path / "result.json"
    args = common.parse_args(
        module.add_arguments, ["--model", str(model), "--quick", *extra, "--json", str(out_json)]
    )
    assert module.run(args) == 0
    return capsys.readouterr().out, json.loads(out_json.read_text())


def test_offline_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, data = _run_quick(offline, tiny_llama_path, tmp_path, capsys, "--parity", "2")
    assert re.search(r"^ratio ours / generate: \d+\.\d+x$", text, re.M), text
    assert re.search(r"^ratio ours / generate_batch: \d+\.\d+x$", text, re.M), text
    assert "greedy parity vs transformers generate (batch 1, unpadded): 2/2 identical" in text
    assert data["ratios"]["ours_over_generate"] > 0
    assert data["prefix_cache_hit_tokens"] == 0
    (ours,) = (v for k, v in data["results"].items() if k.startswith("deja"))
    assert ours["useful_output_tokens"] == ours["computed_output_tokens"] > 0


def test_prefix_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, data = _run_quick(prefix, tiny_llama_path, tmp_path, capsys)
    assert re.search(r"^ratio TTFT off / on \(p50, requests 2\.\.4\): \d+\.\d+x$", text, re.M), text
    # Requests 2..4 reuse the whole 128-token shared prefix (8 full blocks) with the cache on.
    assert data["cache_on"]["cached_tokens_min"] == 128
    assert data["cache_off"]["cached_tokens_max"] == 0
    assert data["identical_outputs"] == 4


@pytest.mark.parametrize("mode", [[], ["--async-scheduling"]])
def test_step_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    text, data = _run_quick(step, tiny_llama_path, tmp_path, capsys, *mode)
    assert data["async_scheduling"] is bool(mode)
    assert re.search(r"^batch 1: step / forward: \d+\.\d+x$", text, re.M), text
    assert re.search(
        r"^batch 1: the core's host work outside the forward \d+\.\d+ ms, mean of the steps "
        r"\(median \d+\.\d+; target <= 0\.25 ms\).*; the front end's text \d+\.\d+ ms more",
        text,
        re.M,
    ), text
    assert [r["batch"] for r in data["results"]] == [1, 4]
    for r in data["results"]:
        ms = r["ms"]
        phases = sum(ms[p] for p in step.PHASES)
        assert abs(phases - ms["step"]) < 1e-6 * max(1.0, ms["step"])
        assert ms["forward"] > 0 and ms["schedule"] > 0 and ms["prepare"] > 0 and ms["sample"] > 0
        assert ms["text"] > 0  # the front end's detokenization, timed apart from the core's step
        core_host = ms["step"] - ms["forward"] - ms["text"]
        assert abs(ms["host"] - core_host) < 1e-6 * max(1.0, ms["step"])
        assert 0 < r["host_p50_ms"] <= ms["step"]


def test_moe_step_alternates_rounds(tiny_llama_path: Path) -> None:
    """`deja bench moe` times its two models' decode steps alternately, in rounds, and reports the
    median step: each model gets every one of its steps, split over the rounds."""
    args = common.parse_args(
        moe.add_arguments,
        ["--batch", "3", "--steps", "5", "--rounds", "2", "--warmup", "1"],
    )
    probes: list[Any] = []
    original = step.StepProbe.time_steps

    def record(self: Any, count: int) -> None:
        probes.append((id(self), count))
        original(self, count)

    path = str(tiny_llama_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step.StepProbe, "time_steps", record)
        result = moe.decode_step_ms({"a": path, "b": path}, args)
    assert [count for _, count in probes] == [3, 3, 2, 2]
    assert probes[0][0] != probes[1][0] and probes[0][0] == probes[2][0]  # a, b, a, b
    for ms in result.values():
        assert ms["step"] > 0 and ms["forward"] > 0


def test_peer_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """deja's side of `deja bench peer` (no vLLM here), with the bf16 agreement check."""
    text, data = _run_quick(
        peer, tiny_llama_path, tmp_path, capsys, "--dtype", "bfloat16", "--agreement", "2"
    )
    assert "cpu flags:" in text
    for key, *_ in peer.COLUMNS:
        assert data["deja"][key] > 0, key
    agree = data["agreement"]
    assert agree["tokens"] == 128
    assert 0 <= agree["free_running"] <= 1 and 0 <= agree["teacher_forced"] <= 1
    for key in ("hf_eager_vs_sdpa_free_running", "hf_eager_vs_sdpa_teacher_forced"):
        assert 0 <= agree[key] <= 1, key
    assert re.search(
        r"yardstick, transformers bfloat16 eager against its sdpa: teacher-forced \d", text
    )
    # The tiny random model's logits are nearly flat, so only the bounds are certain; on the demo
    # model the teacher-forced agreement is ~98%.
    assert re.search(r"teacher-forced \d+\.\d%", text), text


def test_kv_dtype_quick_judges_the_teacher_forced_agreement(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deja bench kv-dtype`: fp8 against the model-dtype KV cache; the verdict follows the
    teacher-forced agreement and the capacity, and both agreements are printed."""
    text, data = _run_quick(kv_dtype, tiny_llama_path, tmp_path, capsys)
    tf, capacity = data["teacher_forced"]["top1_agreement"], data["capacity_vs_bf16"]
    assert capacity == pytest.approx(2.0, rel=0.01)
    want = tf >= kv_dtype.AGREEMENT_TARGET and capacity >= kv_dtype.CAPACITY_TARGET
    assert data["verdict"] == ("PASS" if want else "FAIL")
    assert re.search(r"(PASS|FAIL): teacher-forced agreement \d+\.\d% .*free-running \d", text)


def test_quant_quick_compares_kept_and_expanded_weights(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deja bench quant`: the same GGUF file kept 4-bit and expanded, in one run; the kept
    engine holds fewer weight bytes and the ratios are printed."""
    file = write_gguf(tiny_llama_path, tmp_path / "tiny.gguf", {"proj": "Q4_1", "embed": "Q8_0"})
    text, data = _run_quick(quant, file, tmp_path, capsys, "--depths", "40,96")
    assert data["runs"]["gguf"]["resident_mb"] < data["runs"]["none"]["resident_mb"]
    for run in data["runs"].values():  # each run also decodes after 40 and 96 tokens of context
        assert run["decode_tok_s@40"] > 0 and run["decode_tok_s@96"] > 0
    assert re.search(r"decode at 40 \d+\.\d tok/s, decode at 96 \d+\.\d tok/s$", text, re.M)
    assert 0 < data["teacher_forced"]["top1_agreement"] <= 1
    assert re.search(r"^ratio quantized / expanded: decode \d+\.\d+x", text, re.M), text
    assert re.search(r"^resident weights / file tensors: \d+\.\d+x", text, re.M), text


def test_quant_reports_a_llama_bench_that_dies(tmp_path: Path) -> None:
    """A llama.cpp build this CPU refuses (SIGILL) yields a reason to print, not a traceback."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'illegal instruction' >&2\nkill -ILL $$\n")
    fake.chmod(0o755)
    why = quant.llama_bench(str(fake), str(tmp_path / "model.gguf"), 2, 8)
    assert why == "llama-bench failed (signal 4) illegal instruction"


def test_quant_reads_llama_bench_at_each_depth(tmp_path: Path) -> None:
    """tg and pp512 from a llama-bench call each, tg after each context depth from a third."""
    fake = tmp_path / "llama-bench"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *"-d 64,128"*) echo \'[{"n_prompt": 0, "n_gen": 8, "n_depth": 64, "avg_ts": 90.5},'
        ' {"n_prompt": 0, "n_gen": 8, "n_depth": 128, "avg_ts": 80.25}]\' ;;\n'
        '  *"-p 512 -n 0"*)'
        ' echo \'[{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 400.0}]\' ;;\n'
        '  *"-p 0 -n 8 -r 3"*)'
        ' echo \'[{"n_prompt": 0, "n_gen": 8, "n_depth": 0, "avg_ts": 120.0}]\' ;;\n'
        "  *) echo 'error: invalid parameter for argument: -d' >&2; exit 3 ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    got = quant.llama_bench(str(fake), str(tmp_path / "model.gguf"), 2, 8, (64, 128))
    assert got == {
        "pp512_tok_s": 400.0,
        "tg_tok_s": 120.0,
        "tg_tok_s@64": 90.5,
        "tg_tok_s@128": 80.25,
    }
    plain = {"pp512_tok_s": 400.0, "tg_tok_s": 120.0}
    assert quant.llama_bench(str(fake), str(tmp_path / "model.gguf"), 2, 8) == plain
    # a build that refuses other depths: the figures without them still stand
    assert quant.llama_bench(str(fake), str(tmp_path / "model.gguf"), 2, 8, (32,)) == plain


def test_quant_keeps_llama_cpp_decode_when_its_prompt_path_dies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A build whose prompt processing this CPU refuses (SIGILL in pp512) still gives tg."""
    fake = tmp_path / "llama-bench"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        "  *\"-p 512\"*) echo 'illegal instruction' >&2; kill -ILL $$ ;;\n"
        '  *) echo \'[{"n_prompt": 0, "n_gen": 8, "n_depth": 0, "avg_ts": 150.0}]\' ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    assert quant.llama_bench(str(fake), str(tmp_path / "model.gguf"), 2, 8) == {"tg_tok_s": 150.0}
    assert "pp512: no figure: llama-bench failed (signal 4)" in capsys.readouterr().out


def test_quant_refuses_a_folder(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = common.parse_args(quant.add_arguments, ["--model", str(tiny_llama_path), "--quick"])
    assert quant.run(args) == 2
    assert "is not a GGUF model" in capsys.readouterr().out


def test_spec_quick_compares_with_and_without_speculation(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deja bench spec`: the three workloads with and without speculation in one run; in
    float32 every output is the same token for token."""
    text, data = _run_quick(spec, tiny_llama_path, tmp_path, capsys, "--dtype", "float32")
    for name in ("quoting", "chat", "random"):
        w = data["workloads"][name]
        assert w["identical_outputs"] == w["outputs"] > 0, name
        assert w["ratio"] > 0
    assert re.search(r"^quoting +\d+\.\d +\d+\.\d +\d+\.\d\dx", text, re.M), text
    assert re.search(r"^acceptance rate \d+\.\d%", text, re.M), text


def test_peer_without_vllm_says_so(tiny_llama_path: Path, tmp_path: Path) -> None:
    """A --vllm-python whose environment lacks vLLM fails with a message, not a wrong table."""
    args = common.parse_args(
        peer.add_arguments,
        ["--model", str(tiny_llama_path), "--quick", "--vllm-python", sys.executable],
    )
    job = peer.make_job(str(tiny_llama_path), args)
    with pytest.raises(RuntimeError, match="vLLM's probe failed"):
        peer.run_vllm(job, args)
