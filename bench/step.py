"""`deja bench step`: where one engine step's time goes, at batch 1, 16, 64 and 256 (decode).

For each batch size B, B requests (32-token random prompts, ignore_eos) are prefilled, a few decode
steps warm up, then `--steps` pure-decode steps are timed one by one, split into:
  schedule  the scheduler's decision (Scheduler.schedule)
  prepare   the step's inputs: KV plan copies, the flat batch, the attention plan, the sampling rows
  forward   the model (every layer) and the LM head, or on a GPU the decode CUDA graph's replay;
            on a GPU also its device time (CUDA events)
  wait      on a GPU: the host waiting for a step's sampled ids (its forward and sampling on the
            GPU); with --async-scheduling the ids waited for are the step before's, while this
            step's forward is already queued behind it; 0 on a CPU
  sample    the sampler (penalties, temperature, top-k/p) and unpacking its ids on the host
  output    the rest of the core's step: appending tokens, caching full blocks, stop checks, deltas
  text      the front end's detokenization of those deltas (engine/frontend/output_text.py): in
            `deja serve` it runs in the API server's process, beside the core's next step
The baseline in the same run is the forward pass itself: `host outside forward` (schedule +
prepare + sample + output: the core's step) is what the engine core adds around the model, and
`step / forward` how much slower a step is than its model call (the step here, as in the offline
`LLM`, includes the text). On a GPU, `GPU idle` is 1 - device time / step time, the device time
being the forwards' (CUDA events, counted as they complete, so a step left in flight by async
scheduling counts in the step that reads it).
The default model is a tiny random Llama (2 layers, hidden 64), where the forward costs little and
a step's time is mostly host work; `--model demo` or a folder measures a real one.

    deja bench step [--model tiny|demo|DIR] [--batches 1,16,64,256] [--steps 64] [--device cpu]
                    [--async-scheduling]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import common, report
from engine.core.core_process import freeze_gc_heap

PHASES = ("schedule", "prepare", "forward", "wait", "sample", "output", "text")
CORE_HOST = ("schedule", "prepare", "sample", "output")
"""The engine core's host work outside the forward (what the bounds below are on)."""
HOST_TARGET_MS = {1: 0.25, 256: 1.5}
"""The engine issue's bounds on the core's host work outside the forward, per step, at these
batch sizes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.set_defaults(model="tiny")
    parser.add_argument("--batches", default="1,16,64,256", help="decode batch sizes")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (the engine's default: the C++ kernel on a CPU, cupy on a GPU), torch (reference),"
        " cpu or cupy",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule each step before the last one's ids are on the host (on a CPU nothing "
        "overlaps: this measures the mode's own cost)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no decode CUDA graphs (on a GPU with the cupy backend; the CPU always runs eager)",
    )


class _PhaseClock:
    """Accumulates wall time per phase of the current step (and CUDA event pairs on a GPU)."""

    def __init__(self, cuda: bool) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.cuda = cuda
        self.events: list[tuple[Any, Any]] = []

    def wrap(
        self, obj: Any, attr: str, phase: str, before: Callable[[], None] | None = None
    ) -> None:
        """Replaces obj.attr (a method or a callable object) by a timed call of it; `before`
        runs first, outside the phase's time."""
        setattr(obj, attr, _TimedCall(getattr(obj, attr), self, phase, before))

    def wait_for_device(self) -> None:
        """On a GPU: waits for the last forward's GPU work to end, timed as the "wait" phase."""
        if self.cuda and self.events:
            start = time.perf_counter()
            self.events[-1][1].synchronize()
            self.totals["wait"] += time.perf_counter() - start

    def wrap_forward(self, obj: Any, attr: str) -> None:
        """Times obj.attr (the forward) on the host and, on a GPU, on the device."""
        forward = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.cuda:
                return forward(*args, **kwargs)
            import torch

            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                return forward(*args, **kwargs)
            finally:
                end.record()
                self.events.append((begin, end))

        setattr(obj, attr, timed)
        self.wrap(obj, attr, "forward")

    def wrap_collect(self, runner: Any) -> None:
        """Times the runner's `collect`: waiting for the step's sampled ids as "wait", the rest
        (unpacking them) as "sample"."""
        collect = runner.collect

        def timed(handle: Any) -> Any:
            sampled = handle.sampled
            if self.cuda and sampled is not None and sampled.ready is not None:
                start = time.perf_counter()
                sampled.ready.synchronize()
                self.totals["wait"] += time.perf_counter() - start
            start = time.perf_counter()
            try:
                return collect(handle)
            finally:
                self.totals["sample"] += time.perf_counter() - start

        runner.collect = timed

    def take(self) -> tuple[dict[str, float], float]:
        """This step's seconds per phase (output still 0) and the device seconds of the forwards
        that have completed (without waiting for one in flight); resets."""
        out, self.totals = self.totals, dict.fromkeys(PHASES, 0.0)
        device_s = 0.0
        while self.events and self.events[0][1].query():
            begin, end = self.events.pop(0)
            device_s += begin.elapsed_time(end) / 1000
        return out, device_s

    def flush(self) -> float:
        """Device seconds of the forwards still in flight (waits for them)."""
        device_s = 0.0
        for begin, end in self.events:
            end.synchronize()
            device_s += begin.elapsed_time(end) / 1000
        self.events = []
        return device_s


class _TimedCall:
    """A method or callable object whose calls count towards one phase; other attributes are the
    wrapped object's (the sampler's vocab_size, say)."""

    def __init__(
        self,
        inner: Callable[..., Any],
        clock: _PhaseClock,
        phase: str,
        before: Callable[[], None] | None = None,
    ) -> None:
        self.inner, self.clock, self.phase, self.before = inner, clock, phase, before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before()
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.clock.totals[self.phase] += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _instrument(engine: Any, clock: _PhaseClock) -> None:
    core = getattr(engine, "core", engine)  # older trees: the engine is the core
    runner = core.runner
    clock.wrap(core.scheduler, "schedule", "schedule")
    if hasattr(core, "records"):  # the step's record for the workers
        clock.wrap(core.records, "build", "prepare")
    if hasattr(runner, "inputs"):
        clock.wrap(runner.inputs, "build", "prepare")
    for attr in ("apply_plan", "_build_batch", "_sampling_plan"):  # _build_batch: older runners
        if hasattr(runner, attr):
            clock.wrap(runner, attr, "prepare")
    clock.wrap(runner.backend, "prepare", "prepare")
    if hasattr(runner, "run_model"):  # the forward and the LM head (or a CUDA graph's replay)
        clock.wrap_forward(runner, "run_model")
    else:  # older runners
        clock.wrap(runner.model, "compute_logits", "forward")
        clock.wrap_forward(runner.model, "forward")
    if hasattr(runner, "collect"):  # the sampler starts the ids' copy; `collect` waits for it
        clock.wrap(runner.sampler, "sample", "sample")
        clock.wrap_collect(runner)
    else:  # older runners: the forward's GPU work ends before the sampler's host work is timed
        clock.wrap(runner, "sampler", "sample", before=clock.wait_for_device)
    if hasattr(engine, "text"):
        clock.wrap(engine.text, "apply", "text")


def _async_option(args: argparse.Namespace) -> dict[str, bool]:
    """--async-scheduling as an LLM option, only when given (trees from before the flag take
    the probe too: scripts/compare_trees.sh)."""
    return {"async_scheduling": True} if getattr(args, "async_scheduling", False) else {}


class StepProbe:
    """One engine with `batch` requests prefilled and warmed up, whose pure-decode steps can be
    timed phase by phase in rounds (so two engines' steps can be alternated in one run)."""

    def __init__(self, model_path: str, args: argparse.Namespace, batch: int, steps: int) -> None:
        """steps: how many decode steps `time_steps` will be asked for in all."""
        from engine import SamplingParams

        block_size = 16
        per_seq_blocks = -(-(args.prompt_len + args.warmup + steps + 2) // block_size)
        llm = common.our_llm(
            model_path,
            args,
            device=args.device,
            attention_backend=args.attention_backend,
            enforce_eager=getattr(args, "enforce_eager", False),
            **_async_option(args),
            max_num_seqs=batch,
            num_device_blocks=batch * per_seq_blocks + 8,
            block_size=block_size,
        )
        self.batch = batch
        self.engine: Any = llm.engine
        engine = self.engine
        rng = random.Random(args.seed)
        ids, _ = common.allowed_token_ids(model_path)
        params = SamplingParams(
            temperature=0.0, max_tokens=args.warmup + steps + 2, ignore_eos=True
        )
        for _ in range(batch):
            engine.add_request(common.random_prompt(rng, ids, args.prompt_len), params)
        core = getattr(engine, "core", engine)
        while any(not r.seqs or not r.seqs[0].output_token_ids for r in core.requests.values()):
            engine.step()  # prefill
        for _ in range(args.warmup):
            engine.step()
        freeze_gc_heap()  # as the engine-core process does once its engine is up
        self.clock = _PhaseClock(cuda=core.device.type == "cuda")
        _instrument(engine, self.clock)
        self.samples: list[dict[str, float]] = []
        """Seconds per phase (plus "step" and "device") of every timed step so far."""

    def time_steps(self, count: int) -> None:
        """Times `count` more decode steps into `samples`."""
        for _ in range(count):
            start = time.perf_counter()
            self.engine.step()
            step_s = time.perf_counter() - start
            phases, device_s = self.clock.take()
            phases["output"] = step_s - sum(phases.values())
            host_s = sum(phases[p] for p in CORE_HOST)
            self.samples.append({**phases, "step": step_s, "device": device_s, "host": host_s})
        if self.samples:
            self.samples[-1]["device"] += self.clock.flush()

    def close(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.close()
        del self.engine
        gc.unfreeze()  # the next probe's engine starts from a collectable heap
        gc.collect()  # and without this one's objects, whose cycles would outlive it otherwise

    def mean_ms(self) -> dict[str, float]:
        """Mean milliseconds per phase over the timed steps, plus "host" (the core's host work
        outside the forward: step - forward - text)."""
        ms = {
            name: 1000 * sum(s[name] for s in self.samples) / len(self.samples)
            for name in (*PHASES, "step", "device")
        }
        ms["host"] = sum(ms[p] for p in CORE_HOST)
        return ms

    def median_ms(self, name: str) -> float:
        """The median over the timed steps of one phase (or "step", or "host"), in
        milliseconds."""
        values = sorted(s[name] for s in self.samples)
        mid = len(values) // 2
        return 500 * (values[mid] + values[~mid])


def measure_batch(model_path: str, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """Mean milliseconds per phase over `args.steps` decode steps of `batch` sequences."""
    probe = StepProbe(model_path, args, batch, args.steps)
    probe.time_steps(args.steps)
    probe.close()
    return {
        "batch": batch,
        "ms": probe.mean_ms(),
        "host_p50_ms": probe.median_ms("host"),
        "cuda": probe.clock.cuda,
    }


def _row(r: dict[str, Any]) -> list[Any]:
    ms = r["ms"]
    row = [r["batch"], ms["step"], *(ms[p] for p in PHASES), ms["host"]]
    row += [ms["host"] / ms["step"], ms["step"] / ms["forward"], 1000 / ms["step"]]
    if r["cuda"]:
        row += [ms["device"], 1 - ms["device"] / ms["step"]]
    return row


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    if args.quick:
        batches, args.steps, args.warmup = [1, 4], 8, 2
    model_path, info = common.begin(args, "deja bench step: one decode step, phase by phase")
    results = [measure_batch(model_path, args, b) for b in batches]
    headers = ["batch", "step ms", *(f"{p} ms" for p in PHASES), "core host outside fwd ms"]
    headers += ["host share", "step / forward", "steps/s"]
    if results and results[0]["cuda"]:
        headers += ["device ms", "GPU idle"]
    report.print_table(headers, [_row(r) for r in results], digits=3)
    checks = {}
    for r in results:
        print(
            report.ratio_line(
                f"batch {r['batch']}: step / forward", r["ms"]["step"] / r["ms"]["forward"]
            )
        )
        target = HOST_TARGET_MS.get(r["batch"])
        if target is not None:
            ok = r["ms"]["host"] <= target
            checks[r["batch"]] = ok
            print(
                f"batch {r['batch']}: the core's host work outside the forward "
                f"{r['ms']['host']:.3f} ms, mean of the steps (median {r['host_p50_ms']:.3f}; "
                f"target <= {target} ms): {'MET' if ok else 'NOT MET'}; "
                f"the front end's text {r['ms']['text']:.3f} ms more (in the API server's "
                "process when served)"
            )
    print(report.finish_line(info))
    payload = {
        "machine": info,
        "model": model_path,
        "async_scheduling": bool(getattr(args, "async_scheduling", False)),
        "results": results,
        "targets_met": checks,
    }
    report.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(common.main("deja bench step", __doc__, add_arguments, run))
