"""The engine core: scheduler, KV cache manager and model runner, stepped by one thread.

`EngineCore` takes prepared `Request`s (tokenized and validated by the front end's
`InputProcessor`), and each `step` makes one scheduling decision, runs one forward pass over every
scheduled token, and returns the streamed deltas of the requests with news: token ids, logprobs
and finish reasons. Stop checks run here, next to the scheduler (a stop frees blocks); the text is
made by the front end (engine/frontend/output_text.py), as in vLLM v1.

It runs in the engine-core process (engine/core/core_process.py), in the AsyncEngine's step
thread, or in the caller's thread for the offline `LLM`; the front end's `LLMEngine` adds
tokenization on top.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.beam_step import fail_beam_groups, new_beam_group
from engine.core.builders import (
    kv_cache_manager,
    kv_event_buffer,
    max_model_len,
    model_info,
    remote_loads,
    resolve_config,
)
from engine.core.core_stats import engine_stats
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, SeqStatus
from engine.core.spec.proposer import Proposer
from engine.core.step_rates import StepRates
from engine.core.step_records import RecordedStep, StepRecords
from engine.executor import make_executor
from engine.kv.events import (
    AllBlocksCleared,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
    snapshot_events,
)
from engine.kv.tiers import TieredCache
from engine.kv_io.host_memory import HostMemoryTrimmer
from engine.kv_io.offload import KVOffload
from engine.kv_io.tier_setup import build_tiers, disk_manifest
from engine.outputs import RequestOutput
from engine.sample.structured.compiler import GrammarCompilerPool
from engine.stats import EngineStats
from engine.worker.attention import AttentionBackend
from engine.worker.attention.kv_quant import FP8_DTYPE, KVScales
from engine.worker.kv_calibration import KVCalibration, KVScaleSources, resolve_kv_scales
from engine.worker.model_loader import (
    eos_token_ids,
    load_tokenizer,
    model_fingerprint,
    sampling_defaults,
)
from engine.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step the executor launched and the scheduler advanced, until its output is applied."""

    handle: StepHandle
    step: RecordedStep
    """Its record, and who owns its rows."""
    scheduled_at: float
    counts: tuple[int, int]
    """(prefill tokens, decode sequences): the step rates' sample, taken when it completes."""


class EngineCore:
    """One engine, composed of

    - `executor`: the workers (engine/executor/), rank 0's in this process;
    - `kv`, the KV cache manager, and `tiers`, the CPU and disk tiers' bookkeeping (their
      tensors and files are rank 0's worker's);
    - `scheduler`: decides each step and applies its output (engine/core/scheduler.py);
    - `outputs`: every sample's output state, stop checks and stream deltas;
    - `grammars`: structured outputs' compiles, off the step loop, cached per spec;
    - `records`: each step's plain record for the workers (engine/core/step_records.py);
    - `step_rates`: the measured prefill rate and decode cost, for the router's cost policy.

    It queues prepared requests (`enqueue`) and steps (`step`), in one thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = resolve_config(config)
        self.executor = make_executor(config)  # every rank loads its shard of the model
        worker = self.executor.driver
        hf_config, vocab = worker.shape.hf_config, worker.shape.vocab_size
        self.max_model_len = max_model_len(config.model, hf_config)
        self.tokenizer = load_tokenizer(config.model.path)
        eos = eos_token_ids(config.model.path, hf_config, self.tokenizer)
        self.block_bytes = worker.block_bytes
        defaults = (
            sampling_defaults(config.model.path) if config.model.generation_config == "auto" else {}
        )
        self.model_info = model_info(
            config, worker, self.tokenizer, eos, self.max_model_len, defaults
        )
        self.kv_events = kv_event_buffer(config.cache)  # what each tier began or ceased to hold
        self.kv_scales = self._kv_scales()  # an fp8 cache's: checkpoint, disk or calibrated
        self.tiers = self._allocate_kv_cache(eos)
        cc = config.cache
        self.kv = kv_cache_manager(cc, self.model_info, hf_config, self.tiers, self.kv_events)
        self.remote_loads = remote_loads(self.kv, self.tiers)  # requests awaiting their lookup
        self.grammars = GrammarCompilerPool(self.tokenizer, vocab, eos)
        matcher = self.grammars.new_matcher
        self.outputs = OutputProcessor(self.tokenizer, self.model_info, matcher)
        swap = cc.preemption_mode == "swap"
        self.proposer = None if config.speculative is None else Proposer(config.speculative)
        self.scheduler = Scheduler(
            config.scheduler, self.kv, self.outputs, self.tiers, swap, self.proposer
        )
        self.records = StepRecords(vocab, config.device)
        self.step_rates = StepRates()
        self.requests: dict[str, Request] = {}
        self._grammar_waits: dict[str, tuple[Request, Future[Any]]] = {}  # still compiling
        self._kv_batches = 0
        self._trimmer = HostMemoryTrimmer()  # frees host memory (disk payloads) between steps
        self.async_scheduling = config.async_scheduling and self.executor.world == 1
        self._in_flight: LaunchedStep | None = None  # launched; its sampled ids not yet read

    def _kv_scales(self) -> KVScales | None:
        """An fp8 cache's scales: the checkpoint's, the disk tier's, or a calibration pass
        (every rank joins it); None for a cache in the model's dtype."""
        worker = self.executor.driver
        if worker.kv_dtype != FP8_DTYPE:
            return None
        cc, info = self.config.cache, self.model_info
        manifest = disk_manifest(info, self._fingerprint(), FP8_DTYPE, None)
        run = KVCalibration(
            worker.model, worker.backend, self.tokenizer, self.max_model_len,
            self.executor.peers_calibrate,
        )  # fmt: skip
        shape = (info.num_layers, *worker.layer_shape)
        sources = KVScaleSources(self.config.model.path, cc.disk_dir, manifest, worker.tp_share)
        return resolve_kv_scales(sources, run, shape)

    def _fingerprint(self) -> str | None:
        if not (self.config.cache.disk_dir or self.config.cache.kv_remote):
            return None
        model = self.config.model
        return model_fingerprint(model.path, model.quantization, model.activations)

    def _allocate_kv_cache(self, eos: tuple[int, ...]) -> TieredCache | None:
        """Every rank's device cache, rank 0's CPU and disk tiers (and their bookkeeping,
        `tiers`), the other ranks' tiers as rank 0's, then rank 0's runner."""
        worker = self.executor.driver
        num_blocks = self.model_info.num_device_blocks
        kv_cache = worker.allocate_kv_cache(num_blocks, self.kv_scales)
        built = build_tiers(
            self.config.cache,
            self.model_info,
            self._fingerprint(),
            kv_cache,
            self.block_bytes,
            kv_scales=None if self.kv_scales is None else self.kv_scales.to_json(),
            events=self.kv_events,
            tp=worker.tp_share,
        )
        tiers = None
        if built is not None:
            tiers, worker.offload = built
        cpu_blocks = 0 if worker.offload is None else worker.offload.cpu_cache.shape[2]
        self.executor.allocate_followers(num_blocks, cpu_blocks, worker.offload, self.kv_scales)
        worker.init_runner(eos, self.max_model_len)
        return tiers

    # -- what the workers hold (rank 0's) ------------------------------------------------------
    @property
    def runner(self) -> ModelRunner:
        runner = self.executor.driver.runner
        assert runner is not None
        return runner

    @property
    def offload(self) -> KVOffload | None:
        """Rank 0's CPU tier tensor and disk files (None: no lower tiers)."""
        return self.executor.driver.offload

    @property
    def model(self) -> Any:
        return self.executor.driver.model

    @property
    def backend(self) -> AttentionBackend:
        return self.executor.driver.backend

    @property
    def device(self) -> torch.device:
        return self.executor.driver.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype ('auto' resolved)."""
        dtype: torch.dtype = getattr(torch, self.config.model.dtype)
        return dtype

    @property
    def vocab_size(self) -> int:
        return self.executor.driver.shape.vocab_size

    # -- requests ------------------------------------------------------------------------------
    def enqueue(self, req: Request) -> None:
        """Queues a prepared request (the step loop's thread only).

        A request with a response_format starts its grammar's compile (or finds it cached); until
        it is ready the scheduler steps over the request.
        """
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        fmt = req.params.response_format
        if fmt is not None:
            fut = self.grammars.submit(fmt)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                req.compiled_grammar = fut.result()
            else:
                req.waiting_for_grammar = True
                self._grammar_waits[req.request_id] = (req, fut)
        if req.params.use_beam_search:
            req.beam = new_beam_group(req, self.max_model_len, self.model_info.eos_token_ids)
        req.speculates = self.proposer is not None and self.proposer.eligible(req)
        seq = self.outputs.new_sample(req, 0, list(req.prompt_token_ids))
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        if self.remote_loads is not None:
            self.remote_loads.start(req, seq)

    def abort(self, request_id: str) -> bool:
        """Finishes the request with reason "abort" and frees its blocks now."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._grammar_waits.pop(request_id, None)  # a compile in flight is kept for its cache
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.remove(seq)
                seq.finish("abort")
        if req.beam is not None:
            req.beam.done = True
        self.outputs.touch(req)
        return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Queues the write policy's last writes, flushes the disk tier's queue (at most
        `timeout_s`; None waits for all) and stops its threads, then stops the token mask worker and
        the grammar compiler's (compiles still queued are cancelled); call when done (step thread).

        True when every queued write reached disk; the rest are lost, as after a crash.
        """
        try:
            try:
                self.drain()
            except Exception:  # a failed step must not cost the disk tier its queued writes
                logger.exception("the step in flight failed while the engine closed")
            if self.offload is None:
                return True
            self._between_steps()
            return self.offload.close(timeout_s)
        finally:
            self.executor.close()
            self.records.close()
            self.grammars.close()

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` block hashes this engine holds (device, then CPU, then disk), most
        recently used first within a tier (step thread only): what a replica republishes."""
        pool = self.kv.pool
        in_use = [b.block_hash for b in pool.blocks if b.ref_cnt and b.block_hash is not None]
        free = [b.block_hash for b in pool.free_queue if b.block_hash is not None]
        out = list(dict.fromkeys(in_use + free[::-1]))[:limit]
        if self.tiers is not None and len(out) < limit:
            seen = set(out)
            out += [h for h in self.tiers.cached_hashes(limit) if h not in seen][: limit - len(out)]
        return out

    def take_kv_events(self) -> KVEventBatch | None:
        """The KV events since the last call as one numbered batch, or None when there are none
        (step thread, between steps). After an overflow the batch is AllBlocksCleared followed by
        a snapshot of every tier, with `dropped` set."""
        buf = self.kv_events
        if buf is None or not buf:
            return None
        events, overflowed = buf.take()
        if overflowed:
            events = [AllBlocksCleared(), *self._held_events()]
        self._kv_batches += 1
        return KVEventBatch(self._kv_batches, time.time(), events, overflowed)

    def kv_snapshot(self) -> KVSnapshot:
        """Every hash each tier holds now, as BlockStored events, with the index of the last
        batch taken (step thread, between steps). At most device + CPU + disk-index blocks."""
        return KVSnapshot(self._kv_batches, self._held_events())

    def _held_events(self) -> list[KVEvent]:
        by_medium = [("device", list(self.kv.pool.cached))]
        if self.tiers is not None:
            by_medium += self.tiers.held_by_medium()
        return snapshot_events(self.kv.block_size, by_medium)

    def load_warm_start(self, timeout_s: float | None = None) -> None:
        """Waits for warm start's disk reads and moves them into the CPU tier now (step thread;
        tests and benchmarks; the step loop does this by itself as reads arrive)."""
        if self.offload is not None and self.offload.disk is not None:
            self.offload.disk.wait_warm(timeout_s)
        self._between_steps()

    def _between_steps(self) -> None:
        """The disk tier's work between steps: policy writes, warm-start blocks, index sync."""
        # NOTE: only with no plan pending: every cached device block then holds its bytes.
        if self.offload is not None and self.tiers is not None and not self.kv.plan:
            self.offload.after_step(self.tiers, self.runner.kv_cache, self._device_block_of)

    def _device_block_of(self, block_hash: bytes) -> int | None:
        b = self.kv.pool.lookup(block_hash)
        return None if b is None else b.block_id

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished, or a step still in flight (async scheduling)."""
        return bool(self.requests) or self._in_flight is not None

    def expire_pins(self, now: float | None = None) -> bool:
        """Releases the pins whose TTL has passed (device and CPU tier); True when some were.

        `step` does this; an idle step loop must call it too, or pinned blocks stay held (and
        counted as used) after their TTL until the next request arrives.
        """
        now = time.monotonic() if now is None else now
        before = len(self.kv.pins) + (len(self.tiers.pins) if self.tiers is not None else 0)
        if self.kv.pins:
            self.kv.expire_pins(now)
        if self.tiers is not None and self.tiers.pins:
            self.tiers.expire_pins(now)
        after = len(self.kv.pins) + (len(self.tiers.pins) if self.tiers is not None else 0)
        return after < before

    def trim_host_memory(self, now: float | None = None) -> bool:
        """Gives freed host memory back to the OS, at most every few seconds (engine/host_memory);
        `step` does this; an idle step loop calls it too. True when it trimmed."""
        return self._trimmer.maybe_trim(now)

    def publish_tier_writes(self) -> bool:
        """Turns the remote tier's acknowledged writes into KV events; `step` does this, and an
        idle step loop calls it too, or the blocks a finished request left in the shared tier
        stay unannounced until the next request. True when KV events are waiting."""
        if self.tiers is not None and self.tiers.remote is not None:
            self.tiers.remote.publish_written()
        return bool(self.kv_events)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward pass; returns deltas of requests with news.

        Async scheduling (`async_scheduling`, vLLM's): a step whose sampling reads nothing but
        its logits is left in flight; the next call schedules and launches the following step
        (its pending tokens gathered on the device) before it reads this one's ids, so the host's
        work overlaps the GPU's. Each call then returns the news of the step before."""
        if self._grammar_waits:
            self._poll_grammars()
        if self.remote_loads:
            assert self.remote_loads is not None
            self.remote_loads.poll(self._runnable())
        self._between_steps()
        self.expire_pins()
        sched = self.scheduler.schedule()
        scheduled_at = time.monotonic()
        for seq, message in sched.failed:
            seq.finish("error")
            seq.request.error = message
            self.outputs.touch(seq.request)
        fail_beam_groups(sched.failed, self.scheduler)
        tables = [self.kv.block_ids(item.seq.seq_id) for item in sched.scheduled]
        recorded = self.records.build(sched, tables)
        prev, self._in_flight = self._in_flight, None
        try:
            handle = self.executor.launch(recorded.record, None if prev is None else prev.handle)
        except BaseException:
            if prev is not None:  # its tokens are real: they still reach their sequences
                self._complete(prev, deferred=True)
            raise
        finally:
            self.kv.end_step()
        launched = LaunchedStep(handle, recorded, scheduled_at, self.scheduler.advance(sched))
        if (
            self.async_scheduling
            and handle.deferrable
            and recorded.owners
            and not self._proposing()
        ):
            for item, _ in recorded.owners:  # one row each (deferrable)
                item.seq.num_pending += 1
            self._in_flight = launched
            if prev is not None:
                self._complete(prev, deferred=True)
        else:
            try:
                if prev is not None:
                    self._complete(prev, deferred=True)
            finally:  # its tokens were computed: they reach their sequences whatever happens
                self._complete(launched, deferred=False)
        now = time.monotonic()
        self._between_steps()
        self._trimmer.maybe_trim(now)
        return self.collect_outputs(now)

    def _proposing(self) -> bool:
        """Speculative decoding may propose next step: this one is not left in flight (a
        proposal follows the sample's last token, which must be on the host)."""
        p = self.proposer
        return p is not None and p.active(len(self.scheduler.running))

    def _complete(self, launched: LaunchedStep, *, deferred: bool) -> None:
        """Waits for a launched step's results and brings them into the engine's state."""
        out = self.executor.collect(launched.handle)
        if deferred:  # released first: an error in the update below leaves none behind
            for item, _ in launched.step.owners:
                item.seq.num_pending -= 1
        now = time.monotonic()
        self.step_rates.observe_step(launched.counts, launched.scheduled_at, now, deferred)
        self.scheduler.update_from_output(launched.step, out, now, deferred=deferred)
        for req, _ in launched.step.beam_groups:  # the tokens the search chose, for the workers
            for seq in req.seqs:
                self.records.appended(seq)

    def drain(self) -> None:
        """Completes the step left in flight, if any (async scheduling; step thread)."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._complete(launched, deferred=True)

    def _poll_grammars(self) -> None:
        """Releases requests whose grammar finished compiling (or fails them with its error).

        Only when nothing else can run does this wait (briefly) for a compile to finish.
        """
        if not self._runnable():
            futures = [f for _, f in self._grammar_waits.values()]
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)
        for rid, (req, fut) in list(self._grammar_waits.items()):
            if not fut.done():
                continue
            del self._grammar_waits[rid]
            if self.requests.get(rid) is not req or req.finished:
                continue  # aborted while compiling
            error = "grammar compile cancelled" if fut.cancelled() else fut.exception()
            if error is not None:
                req.error = str(error)
                for seq in req.seqs:
                    self.scheduler.finish(seq, "error")
                self.outputs.touch(req)
                continue
            req.compiled_grammar = fut.result()
            req.waiting_for_grammar = False
            for seq in req.seqs:
                seq.grammar = self.grammars.new_matcher(req.compiled_grammar)

    def _runnable(self) -> bool:
        """Whether a sequence can be scheduled now (none waits on a grammar or a lookup)."""
        return bool(self.scheduler.running) or any(
            not (s.request.waiting_for_grammar or s.request.waiting_for_remote)
            for s in self.scheduler.waiting
        )

    def collect_outputs(self, now: float | None = None) -> list[RequestOutput]:
        """Deltas of every request with news since the last call (step() calls it)."""
        now = time.monotonic() if now is None else now
        outs = self.outputs.make_outputs()
        for out in outs:
            if out.finished:
                req = self.requests.pop(out.request_id)
                req.metrics.finished = now
                self.records.forget(req)
                if self.proposer is not None:
                    self.proposer.finished(req)
        return outs

    # -- stats ---------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return engine_stats(self)
