"""One user's latency: `deja serve` over gRPC vs the offline engine vs transformers `generate`.

One request at a time, greedy, --new-tokens tokens with EOS ignored, a prompt of --prompt-len
random ordinary token ids (a fresh prompt per repetition, the same prompts for every system, so no
prefix-cache hit flatters anyone). Three systems, one after another in this run, never two at once:

- served: a real `deja serve` subprocess on a free port, driven by the real gRPC client
  (`DejaClient`, streaming) from this process; timed on the client side;
- offline: the in-process engine (`LLMEngine.add_request` + `step()`, what `LLM.generate` runs) in
  this process's main thread, once the server is gone;
- transformers: `generate` batch 1 on the same weights and dtype (greedy), timed with a streamer.

TTFT = from sending the request to the first token (served: the first message that carries a
token). Decode tok/s = (tokens - 1) / (time of the last token - time of the first token). Each
system gets one unmeasured warm-up request; the table shows medians over --repeats. Targets:
served / offline decode >= 0.95, served / transformers decode >= 1.2, served TTFT -
offline TTFT <= 10 ms.

    deja bench latency [--model demo] [--repeats 3] [--json out.json]

With --gateway it measures another pair instead: the SMG gateway in front of a replica vs that
same replica's deja.v1, one user and under load (bench/gateway_overhead.py).
"""

from __future__ import annotations

import argparse
import gc
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import common, gateway_overhead, report
from bench.report import Check

TARGET_DECODE_VS_OFFLINE = 0.95
TARGET_DECODE_VS_TRANSFORMERS = 1.2
TARGET_TTFT_EXTRA_MS = 10.0
FULL = {"prompt_len": 128, "new_tokens": 96, "repeats": 3}
QUICK = {"prompt_len": 16, "new_tokens": 8, "repeats": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    parser.add_argument("--new-tokens", type=int, default=None, help="output tokens (default 96)")
    parser.add_argument("--repeats", type=int, default=None, help="measured requests (default 3)")
    parser.add_argument(
        "--skip-transformers", action="store_true", help="leave out transformers generate"
    )
    parser.add_argument(
        "--server-args", default="", help="extra `deja serve` flags for the spawned server"
    )
    parser.add_argument(
        "--server-start-timeout", type=float, default=300.0, help="seconds to wait for health"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a target is missed (default: report)"
    )
    gateway_overhead.add_arguments(parser)


@dataclass(slots=True)
class Sample:
    """One measured request."""

    ttft_s: float
    """Request sent -> first token seen."""
    decode_s: float
    """First token -> last token."""
    tokens: list[int] = field(repr=False)
    cached_tokens: int = 0
    """Prompt tokens served from a prefix cache (expected 0: every prompt is new)."""

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(slots=True)
class SystemResult:
    name: str
    samples: list[Sample]

    @property
    def ttft_ms(self) -> float:
        return 1e3 * common.p50([s.ttft_s for s in self.samples])

    @property
    def decode_tok_s(self) -> float:
        return common.p50([s.decode_tok_s for s in self.samples])

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_ms_p50": self.ttft_ms,
            "decode_tok_s_p50": self.decode_tok_s,
            "ttft_ms": [1e3 * s.ttft_s for s in self.samples],
            "decode_tok_s": [s.decode_tok_s for s in self.samples],
            "output_tokens": [len(s.tokens) for s in self.samples],
            "cached_tokens": [s.cached_tokens for s in self.samples],
        }


class _TokenClock:
    """Records when each token was seen: first and last time, and the tokens."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.tokens: list[int] = []

    def saw(self, ids: list[int]) -> None:
        if not ids:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens.extend(ids)

    def sample(self, cached: int = 0) -> Sample:
        if self.first is None:
            raise RuntimeError("the request produced no token")
        return Sample(self.first - self.t0, self.last - self.first, self.tokens, cached)


# -- served ------------------------------------------------------------------------------------
def _serve_supports(flag: str) -> bool:
    """Whether `deja serve` has `flag` (engine flags differ between versions)."""
    from service.replica import command as serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return flag in parser._option_string_actions


def serve_command(model_path: str, args: argparse.Namespace, port: int) -> list[str]:
    """`deja serve` with this benchmark's engine settings (the offline engine gets the same)."""
    from clients.testing.cluster import serve_argv

    extra = ["--dtype", args.dtype, "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    extra += ["--cpu-swap-gib", "0"]
    if args.num_device_blocks is not None:
        extra += ["--num-device-blocks", str(args.num_device_blocks)]
    if _serve_supports("--threads"):
        extra += ["--threads", str(args.threads)]
    extra += args.server_args.split()
    return serve_argv(model_path, port=port, replica_id="bench-latency", extra=extra)


def run_served(
    model_path: str, args: argparse.Namespace, prompts: list[list[int]], warmup: list[int]
) -> SystemResult:
    from clients.client import DejaClient
    from clients.testing.cluster import serving
    from service.common.ports import free_port

    port = free_port()
    target = f"127.0.0.1:{port}"
    argv = serve_command(model_path, args, port)
    timeout = args.server_start_timeout
    # OMP_NUM_THREADS sizes torch's intra-op pool in the server like --threads does here.
    with (
        tempfile.TemporaryDirectory(prefix="deja-bench-latency-") as tmp,
        serving(Path(tmp), "serve", argv, target, timeout, omp_threads=args.threads) as group,
    ):
        with DejaClient(target, retries=0) as client:
            _served_one(client, warmup, args.new_tokens)
            samples = [_served_one(client, p, args.new_tokens) for p in prompts]
        group.check_alive("serve")
    return SystemResult("served (gRPC)", samples)


def _served_one(client: Any, prompt: list[int], new_tokens: int) -> Sample:
    clock = _TokenClock()
    cached = 0
    for msg in client.generate(
        prompt, max_tokens=new_tokens, temperature=0.0, ignore_eos=True, return_token_ids=True
    ):
        clock.saw([t for c in msg.choices for t in c.token_ids])
        if msg.HasField("final"):
            cached = msg.final.usage.cached_prompt_tokens
    return clock.sample(cached)


# -- offline -----------------------------------------------------------------------------------
def run_offline(
    model_path: str, args: argparse.Namespace, prompts: list[list[int]], warmup: list[int]
) -> SystemResult:
    from engine import SamplingParams

    llm = common.our_llm(
        model_path, args, num_device_blocks=args.num_device_blocks, cpu_swap_gib=0.0
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    try:
        _offline_one(llm.engine, warmup, params)
        samples = [_offline_one(llm.engine, p, params) for p in prompts]
    finally:
        llm.engine.close()
        del llm
        gc.collect()
    return SystemResult("offline (LLMEngine)", samples)


def _offline_one(engine: Any, prompt: list[int], params: Any) -> Sample:
    clock = _TokenClock()
    engine.add_request(prompt, params)
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            clock.saw([t for c in out.outputs for t in c.token_ids])
            if out.finished:
                cached = out.num_cached_tokens
    return clock.sample(cached)


# -- transformers ------------------------------------------------------------------------------
def run_transformers(
    model_path: str, args: argparse.Namespace, prompts: list[list[int]], warmup: list[int]
) -> SystemResult:
    from bench.hf_baselines import load_hf_model, pad_token_id

    model = load_hf_model(model_path, args.dtype)
    pad = pad_token_id(model)
    try:
        _hf_one(model, warmup, args.new_tokens, pad)
        samples = [_hf_one(model, p, args.new_tokens, pad) for p in prompts]
    finally:
        del model
        gc.collect()
    return SystemResult("transformers generate", samples)


def _hf_one(model: Any, prompt: list[int], new_tokens: int, pad_id: int) -> Sample:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Streamer(BaseStreamer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.prompt_seen = False
            self.clock = _TokenClock()

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate first puts the prompt
                self.prompt_seen = True
                return
            self.clock.saw([int(t) for t in value.reshape(-1).tolist()])

        def end(self) -> None:
            pass

    ids = torch.tensor([prompt], dtype=torch.long)
    streamer = Streamer()
    with torch.inference_mode():
        streamer.clock.t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS ignored, like the other two
            do_sample=False,
            pad_token_id=pad_id,
            streamer=streamer,
        )
    return streamer.clock.sample()


# -- report ------------------------------------------------------------------------------------
def checks(served: SystemResult, offline: SystemResult, hf: SystemResult | None) -> list[Check]:
    """The latency targets, evaluated on the medians."""
    out = [
        Check(
            "served / offline decode",
            served.decode_tok_s / offline.decode_tok_s,
            f">= {TARGET_DECODE_VS_OFFLINE}",
            served.decode_tok_s >= TARGET_DECODE_VS_OFFLINE * offline.decode_tok_s,
        )
    ]
    if hf is not None:
        out.append(
            Check(
                "served / transformers decode",
                served.decode_tok_s / hf.decode_tok_s,
                f">= {TARGET_DECODE_VS_TRANSFORMERS}",
                served.decode_tok_s >= TARGET_DECODE_VS_TRANSFORMERS * hf.decode_tok_s,
            )
        )
    extra = served.ttft_ms - offline.ttft_ms
    out.append(
        Check(
            "served TTFT - offline TTFT (ms)",
            extra,
            f"<= {TARGET_TTFT_EXTRA_MS}",
            extra <= TARGET_TTFT_EXTRA_MS,
        )
    )
    return out


def run(args: argparse.Namespace) -> int:
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the spawned server is stopped too.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    if args.gateway:
        return gateway_overhead.run(args, lambda model, port: serve_command(model, args, port))
    vars(args).update(common.resolve_workload(args, FULL, QUICK))
    if args.new_tokens < 2 or args.repeats < 1 or args.prompt_len < 1:
        print("deja bench latency: needs --new-tokens >= 2, --repeats >= 1", file=sys.stderr)
        return 2
    title = "one-user latency: served vs offline vs transformers"
    model_path, info = common.begin(args, title)
    print(
        f"workload: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy, EOS "
        f"ignored), {args.repeats} measured requests per system after 1 warm-up, {args.dtype}"
    )
    ids, _ = common.allowed_token_ids(model_path)
    rng = random.Random(args.seed)
    prompts = [common.random_prompt(rng, ids, args.prompt_len) for _ in range(args.repeats + 3)]
    warm = {"served": prompts[0], "offline": prompts[1], "transformers": prompts[2]}
    measured = prompts[3:]

    served = run_served(model_path, args, measured, warm["served"])
    offline = run_offline(model_path, args, measured, warm["offline"])
    hf = None
    if not args.skip_transformers:
        hf = run_transformers(model_path, args, measured, warm["transformers"])
    systems = [s for s in (served, offline, hf) if s is not None]

    rows = [
        [s.name, s.ttft_ms, s.decode_tok_s, " ".join(f"{x.decode_tok_s:.1f}" for x in s.samples)]
        for s in systems
    ]
    report.print_table(
        ["system", "TTFT ms (p50)", "decode tok/s (p50)", "decode tok/s per run"], rows
    )
    same = sum(a.tokens == b.tokens for a, b in zip(served.samples, offline.samples, strict=True))
    print(f"greedy tokens served == offline: {same}/{len(measured)} requests")
    cached = sum(x.cached_tokens for s in (served, offline) for x in s.samples)
    print(f"prefix-cache hits on measured prompts: {cached} tokens (expected 0)")
    results = checks(served, offline, hf)
    for c in results:
        print(f"{c.name}: {c.value:.2f} (target {c.target}) {'PASS' if c.ok else 'FAIL'}")
    print(report.finish_line(info))
    report.write_json(
        args.json,
        {
            "machine": info,
            "model": model_path,
            "workload": {
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "dtype": args.dtype,
                "threads": args.threads,
            },
            "results": {s.name: s.to_json() for s in systems},
            "identical_served_offline": same,
            "checks": {c.name: {"value": c.value, "target": c.target, "ok": c.ok} for c in results},
            "load_avg_now": report.load_avg(),
        },
    )
    if same != len(measured):
        print("served and offline greedy tokens differ", file=sys.stderr)
        return 1
    return 1 if args.strict and not all(c.ok for c in results) else 0
