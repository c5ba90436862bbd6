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

import itertools
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.beam_step import fail_beam_groups, new_beam_group
from engine.core.core_stats import engine_stats
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, SeqStatus, Sequence
from engine.core.step_rates import StepRates
from engine.core.step_update import LaunchedStep, StepUpdate
from engine.kv.events import (
    AllBlocksCleared,
    KVEvent,
    KVEventBatch,
    KVEventBuffer,
    KVSnapshot,
    snapshot_events,
)
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredCache
from engine.kv_io.host_memory import HostMemoryTrimmer
from engine.kv_io.offload import KVOffload, TPShare, build_tiers, disk_manifest
from engine.outputs import RequestOutput
from engine.sample.sampler import Sampler
from engine.sample.structured.compiler import GrammarCompilerPool
from engine.stats import EngineStats, ModelInfo
from engine.worker.attention import get_attention_backend
from engine.worker.attention.kv_quant import FP8_DTYPE, KVScales, kv_block_bytes
from engine.worker.cpu_features import resolve_device, resolve_dtype
from engine.worker.kv_calibration import (
    KVCalibration,
    KVScaleSources,
    kv_cache_storage,
    resolve_kv_scales,
)
from engine.worker.model_loader import (
    eos_token_ids,
    kv_dims,
    load_model,
    load_tokenizer,
    model_fingerprint,
    read_hf_config,
)
from engine.worker.model_runner import ModelRunner
from engine.worker.models.sliding_window import kv_window, layer_windows
from engine.worker.parallel.executor import tp_executor

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineCore(StepUpdate):
    """One engine: loads the model and its KV cache, queues requests, steps."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        # 'auto' dtype decided once, here, for the device found: everything below sees it.
        dtype = resolve_dtype(config.model.dtype, self.device.type)
        config = replace(config, model=replace(config.model, dtype=dtype))
        mc = config.model
        self.dtype = _DTYPES[mc.dtype]
        hf_config = read_hf_config(mc.path)
        max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
        if mc.max_model_len is not None and mc.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len {mc.max_model_len} exceeds the model's max_position_embeddings {max_pos}"
            )
        self.max_model_len = mc.max_model_len or max_pos
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.tp = tp_executor(config, hf_config, self.device)
        """Ranks 1..N-1 of tensor parallelism (this process is rank 0); None: N = 1."""
        group = None if self.tp is None else self.tp.group
        self.model, hf_config = load_model(mc, self.device, self.backend, group)
        self.tokenizer = load_tokenizer(mc.path)
        num_layers, num_kv_heads, head_dim = kv_dims(hf_config)
        # each rank's cache holds its own KV heads (engine/worker/parallel/group.py)
        rank_kv_heads = num_kv_heads if group is None else group.kv_heads(num_kv_heads)[1]
        cc = config.cache
        self.kv_dtype = kv_cache_storage(cc.kv_cache_dtype, self.dtype, self.backend)
        """The KV cache's storage dtype on every tier (fp8: quantized with `kv_scales`)."""
        # NOTE: an fp8 block is half a bf16 one: the same budgets hold twice the blocks.
        self.block_bytes = kv_block_bytes(
            num_layers, cc.block_size, rank_kv_heads, head_dim, self.kv_dtype
        )
        num_blocks = cc.num_device_blocks or max(
            1, int(cc.device_memory_gib * 2**30) // self.block_bytes
        )
        self.vocab_size = int(hf_config.vocab_size)
        eos = eos_token_ids(mc.path, hf_config, self.tokenizer)
        self.model_info = ModelInfo(
            model_id=mc.model_id or os.path.basename(os.path.normpath(mc.path)),
            family="qwen2" if hf_config.model_type == "qwen2" else "llama",
            architecture=(hf_config.architectures or ["LlamaForCausalLM"])[0],
            max_model_len=self.max_model_len,
            block_size=cc.block_size,
            dtype=mc.dtype,
            kv_cache_dtype=cc.kv_cache_dtype,
            vocab_size=self.vocab_size,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_device_blocks=num_blocks,
            eos_token_ids=eos,
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
        )
        self.config = config
        self.tiers: TieredCache | None = None
        self.offload: KVOffload | None = None
        self.kv_events = (
            KVEventBuffer(cc.kv_events_max_blocks, cc.block_size)
            if cc.kv_events_max_blocks and cc.enable_prefix_caching
            else None
        )
        """Which hashes each tier started or stopped holding since `take_kv_events`."""
        self._kv_batches = 0
        fingerprint = model_fingerprint(mc.path) if cc.disk_dir else None
        layer_shape = (cc.block_size, rank_kv_heads, head_dim)
        self.kv_scales: KVScales | None = None
        """Per-layer K and V scales of an fp8 cache (checkpoint, disk manifest or calibrated)."""
        share = None if group is None else TPShare(0, group.world, *group.kv_heads(num_kv_heads))
        if self.kv_dtype == FP8_DTYPE:
            manifest = disk_manifest(self.model_info, fingerprint, FP8_DTYPE, None)
            peers = None if self.tp is None else self.tp.calibrate
            self.kv_scales = resolve_kv_scales(
                KVScaleSources(mc.path, cc.disk_dir, manifest, share),
                KVCalibration(self.model, self.backend, self.tokenizer, self.max_model_len, peers),
                (num_layers, *layer_shape),
            )
        kv_cache = torch.zeros(
            (num_layers, 2, num_blocks, *layer_shape), dtype=self.kv_dtype, device=self.device
        )
        self.backend.bind_kv_cache(kv_cache, self.kv_scales)
        built = build_tiers(
            cc,
            self.model_info,
            fingerprint,
            kv_cache,
            self.block_bytes,
            kv_scales=None if self.kv_scales is None else self.kv_scales.to_json(),
            events=self.kv_events,
            tp=share,
        )
        if built is not None:
            self.tiers, self.offload = built
        if self.tp is not None:
            cpu_blocks = 0 if self.offload is None else self.offload.cpu_cache.shape[2]
            self.tp.allocate(num_blocks, cpu_blocks, self.offload, self.kv_scales)
        # NOTE: blocks leave a sequence as its window moves on only when every layer slides;
        # swap preemption holds a sequence's whole table in the CPU tier, so it keeps them all.
        window = kv_window(layer_windows(hf_config)) if cc.preemption_mode != "swap" else None
        self.kv = KVCacheManager(
            num_blocks,
            cc.block_size,
            enable_caching=cc.enable_prefix_caching,
            max_pinned_fraction=cc.max_pinned_fraction,
            tiers=self.tiers,
            events=self.kv_events,
            sliding_window=window,
        )
        swap = self.tiers if cc.preemption_mode == "swap" else None
        self.scheduler = Scheduler(config.scheduler, self.kv, swap=swap)
        self.step_rates = StepRates()
        """Measured prefill rate and decode cost, published for the router's cost policy."""
        sampler = Sampler(self.vocab_size, self.device, config.seed)
        self.runner = ModelRunner(
            self.model,
            self.backend,
            kv_cache,
            sampler,
            cc.block_size,
            eos,
            self.device,
            offload=self.offload,
            tp=self.tp,
            max_graph_batch=config.cuda_graph_batch(),
            max_model_len=self.max_model_len,
        )
        self.grammars = GrammarCompilerPool(self.tokenizer, self.vocab_size, eos)
        """Structured outputs: compiles response formats off the step loop, cached per spec."""
        self._grammar_waits: dict[str, tuple[Request, Future[Any]]] = {}
        """Queued requests whose grammar is compiling."""
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        """Stop checks, detokenization and stream deltas (engine/core/output_processor.py)."""
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._touched: dict[str, Request] = {}
        """Requests with news since the last step's outputs were built."""
        self._trimmer = HostMemoryTrimmer()
        """Gives freed host memory (disk-tier payloads) back to the OS between steps."""
        self.async_scheduling = config.async_scheduling and self.tp is None
        """Leave a step's results in flight while the next one is scheduled (`step`)."""
        self._in_flight: LaunchedStep | None = None
        """The step launched and advanced whose sampled ids are not yet processed."""

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
        n, seed = req.params.num_samples, req.params.seed
        req.generators = [None] * n
        if seed is not None:
            req.generators = [
                torch.Generator(device=self.device).manual_seed(seed + i) for i in range(n)
            ]
        seq = self._new_seq(req, 0, list(req.prompt_token_ids))
        self.requests[req.request_id] = req
        self.scheduler.add(seq)

    def _new_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), req, index, token_ids, self.kv.block_size)
        if req.compiled_grammar is not None:
            seq.grammar = self.grammars.new_matcher(req.compiled_grammar)
        if req.beam is None:
            self.outputs.add_sample(seq)
        req.seqs.append(seq)
        return seq

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
        self._touched[request_id] = req
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
            self.runner.close()
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

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward pass; returns deltas of requests with news.

        Async scheduling (`async_scheduling`, vLLM's): a step whose sampling reads nothing but
        its logits is left in flight; the next call schedules and launches the following step
        (its pending tokens gathered on the device) before it reads this one's ids, so the host's
        work overlaps the GPU's. Each call then returns the news of the step before."""
        if self._grammar_waits:
            self._poll_grammars()
        self._between_steps()
        self.expire_pins()
        sched = self.scheduler.schedule()
        scheduled_at = time.monotonic()
        for seq, message in sched.failed:
            seq.finish("error")
            seq.request.error = message
            self._touched[seq.request.request_id] = seq.request
        fail_beam_groups(sched.failed, self.scheduler)
        tables = [self.kv.block_ids(item.seq.seq_id) for item in sched.scheduled]
        prev, self._in_flight = self._in_flight, None
        try:
            in_flight = None if prev is None else prev.handle.token_ids
            handle = self.runner.launch(sched, tables, in_flight)
        except BaseException:
            if prev is not None:  # its tokens are real: they still reach their sequences
                self._complete(prev, deferred=True)
            raise
        finally:
            self.kv.end_step()
        launched = LaunchedStep(handle, scheduled_at, self._advance(sched))
        if self.async_scheduling and handle.deferrable and handle.owners:
            for row, (item, _) in enumerate(handle.owners):  # one row each (deferrable)
                seq = item.seq
                seq.num_pending += 1
                seq.pending_row = row
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

    def _complete(self, launched: LaunchedStep, *, deferred: bool) -> None:
        """Waits for a launched step's results and brings them into the engine's state."""
        out = self.runner.collect(launched.handle)
        if deferred:  # released first: an error in the update below leaves none behind
            for item, _ in out.owners:
                item.seq.num_pending -= 1
        self.update_from_output(launched, out, time.monotonic(), deferred=deferred)

    def drain(self) -> None:
        """Completes the step left in flight, if any (async scheduling; step thread)."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._complete(launched, deferred=True)

    def _poll_grammars(self) -> None:
        """Releases requests whose grammar finished compiling (or fails them with its error).

        Only when nothing else can run does this wait (briefly) for a compile to finish.
        """
        runnable = bool(self.scheduler.running) or any(
            not s.request.waiting_for_grammar for s in self.scheduler.waiting
        )
        if not runnable:
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
                    self._finish(seq, "error", None)
                self._touched[rid] = req
                continue
            req.compiled_grammar = fut.result()
            req.waiting_for_grammar = False
            for seq in req.seqs:
                seq.grammar = self.grammars.new_matcher(req.compiled_grammar)

    def collect_outputs(self, now: float | None = None) -> list[RequestOutput]:
        """Deltas of every request with news since the last call (step() calls it)."""
        now = time.monotonic() if now is None else now
        outs = self.outputs.make_outputs(self._touched)
        for out in outs:
            if out.finished:
                self.requests.pop(out.request_id).metrics.finished = now
        self._touched = {}
        return outs

    # -- stats ---------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return engine_stats(self)
