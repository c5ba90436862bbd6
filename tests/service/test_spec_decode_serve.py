"""Speculative decoding through the service: a real server with --speculative-config reports
each request's acceptance in its usage and its span, and the engine's counters in /metrics
(vLLM's spec_decode names); beam search is refused with INVALID_ARGUMENT; a malformed
--speculative-config stops `deja serve` before it loads anything."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.service.conftest import StartServer, make_engine
from tests.service.test_observability import _provider, _scrape, _spans
from tests.support.checkpoints import with_other_tokenizer
from tests.support.waiting import wait_until

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 4  # repeats: prompt lookup proposes from it


async def test_usage_spans_and_metrics_report_acceptance(
    tiny_llama_path: Path, start_server: StartServer
) -> None:
    engine = make_engine(tiny_llama_path, speculative_config=SPEC)
    try:
        provider, spans = _provider()
        h = await start_server(engine, metrics_port=0, tracer_provider=provider)
        plain = await h.client.complete(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
        assert plain.final is not None
        spec = plain.final.usage.speculative
        assert plain.final.usage.HasField("speculative")
        assert spec.draft_tokens > 0 and spec.accepted_tokens > 0
        assert spec.acceptance_rate == pytest.approx(spec.accepted_tokens / spec.draft_tokens)
        done = plain.final.usage.completion_tokens
        assert spec.tokens_per_step == pytest.approx(done / (done - spec.accepted_tokens))
        (span,) = await _spans(spans)
        assert span.attributes is not None
        assert span.attributes["deja.spec_decode.accepted_tokens"] == spec.accepted_tokens
        assert span.attributes["deja.spec_decode.draft_tokens"] == spec.draft_tokens

        port = h.replica.metrics_port
        assert port is not None
        m: dict[str, float] = {}

        async def refreshed() -> bool:
            m.update(await asyncio.to_thread(_scrape, port))
            return m.get("deja_spec_decode_num_accepted_tokens_total{}", 0) > 0

        await wait_until(refreshed, what="the spec_decode counters")
        assert m["deja_spec_decode_num_accepted_tokens_total{}"] == spec.accepted_tokens
        assert m["deja_spec_decode_num_draft_tokens_total{}"] == spec.draft_tokens
        assert m["deja_spec_decode_num_drafts_total{}"] > 0
        assert m["deja_spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.client.complete(PROMPT, max_tokens=4, n=2, use_beam_search=True, temperature=0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculative decoding" in (err.value.details() or "")
        await h.assert_clean()
    finally:
        engine.shutdown()


def _serve(model: Path, spec: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--port", "0",
            "--speculative-config", spec,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def test_serve_refuses_a_malformed_speculative_config(tiny_llama_path: Path) -> None:
    proc = _serve(tiny_llama_path, '{"method": "ngram", "num_speculative_tokens": 0}')
    assert proc.returncode == 2
    assert "num_speculative_tokens must be in [1, 32]" in proc.stderr


def test_serve_refuses_a_draft_model_with_another_tokenizer(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    other = with_other_tokenizer(tiny_llama_path, tmp_path / "other")
    proc = _serve(tiny_llama_path, json.dumps({"model": str(other)}))
    assert proc.returncode == 2
    assert "has another tokenizer than the target" in proc.stderr
