"""The remote tier's store: a Redis-protocol client with a writer thread and a lookup thread.

Nothing here runs on the step's critical path:
- Writes go behind (`store`): the step thread hands over a payload already copied off the KV
  cache and returns; a writer thread sends queued values in batches, pipelined (`SET key value
  EX ttl`). At most `max_queued` values wait; a store past that is refused and counted (the step
  never blocks on the store). A value the store refuses (full: `maxmemory` under `noeviction`) is
  counted and dropped.
- Lookups run in a thread of their own (`lookup`): the engine asks, when a request arrives, for
  the blocks past what it holds locally; the thread reads them in pipelined batches (`GETEX`,
  which also refreshes the TTL of a block that is being used), checks every value
  (engine/kv_io/remote_format.py) and stops at the first block that is absent or bad. The
  request waits (others step) until its lookup is done; the verified payloads wait in this
  store's buffer (`accept`, `buffered`) until the request is admitted and they are loaded.
- A failed or timed-out operation (every one is bounded by `timeout_s`) marks the store down for
  `retry_s`: lookups answer "nothing" at once and writes are dropped, so an outage or a slow
  store costs requests their remote hits, never their answers or a step's time.
A bad value is deleted (a later writer replaces it) and counted by its reason.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
import torch

from engine.kv.hashing import BlockHash
from engine.kv_io.disk_writer import Ready, wait_until_idle
from engine.kv_io.remote_format import BadValue, decode, encode, key

log = logging.getLogger(__name__)

WRITE_BATCH = 32
"""Values sent in one pipelined round trip at most."""
READ_BATCH = 16
"""Values read in one pipelined round trip at most (a lookup stops early at a miss)."""


@dataclass(frozen=True, slots=True)
class _Write:
    block_hash: BlockHash
    payload: torch.Tensor
    ready: Ready | None


class RemoteKV:
    """One engine's (one rank's) client of the shared remote tier."""

    def __init__(
        self,
        url: str,
        tag: bytes,
        payload_bytes: int,
        *,
        key_prefix: str = "deja:kv:",
        ttl_s: float = 86400.0,
        timeout_s: float = 1.0,
        retry_s: float = 2.0,
        max_queued: int = 512,
        buffer_blocks: int = 1024,
    ) -> None:
        self.url = url
        self._shown_url = re.sub(r"//[^@/]*@", "//", url)
        """The URL without credentials (for logs)."""
        self.tag = tag
        """The writer's layout tag (engine/kv_io/remote_format.py): in every key and header."""
        self.payload_bytes = payload_bytes
        self.key_prefix = key_prefix
        self.ttl_s = max(1, int(ttl_s))
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_queued = max_queued
        self.buffer_blocks = max(1, buffer_blocks)
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._down_until = 0.0
        """monotonic time before which the store is not tried (after a failure)."""
        self._outage_logged = False
        self._queued = 0
        self._unfinished = 0
        self._written: list[BlockHash] = []
        """Hashes whose SET the store acknowledged since the last `take_written`."""
        self.num_writes = 0
        """Values the store acknowledged."""
        self.num_refused = 0
        """Stores refused: the writer's queue was full or the store was down."""
        self.num_full = 0
        """Values the store refused for want of memory (maxmemory under noeviction)."""
        self.num_write_errors = 0
        """Values lost to a failed or timed-out write."""
        self.num_outages = 0
        """Times the store failed after answering (it may have lost its values meanwhile)."""
        self.num_lookups = 0
        self.num_skipped_lookups = 0
        """Lookups answered "nothing" because the store was down."""
        self.num_found = 0
        """Blocks found, verified and handed to the engine."""
        self._misses: Counter[str] = Counter()
        """Lookups that ended on a value that was there but unusable, or on a failure, by
        reason (engine/kv_io/remote_format.py's MISS_REASONS); `misses` reads them."""
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="deja-kv-remote-writer")
        self._writer.daemon = True
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="deja-kv-remote-lookup")
        self._buffer: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        """Verified payloads waiting to be loaded (step thread), least recently accepted first."""
        self._loaded: list[BlockHash] = []
        """Payloads loaded in this step (dropped at `end_step`)."""
        self.peers: list[tuple[bytes, int]] = []
        """Tensor-parallel rank 0: (layout tag, payload bytes) of ranks 1..N-1, whose shares its
        lookups read and check too (a block is found only with every share)."""
        self._peer_shares: dict[BlockHash, list[torch.Tensor]] = {}
        """Verified shares of ranks 1..N-1 of the buffered blocks (rank 0)."""

    # -- availability --------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while the store is left alone after a failure."""
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_s
            first, self._outage_logged = not self._outage_logged, True
            self.num_outages += first
        if first:
            log.warning(
                "remote KV tier %s: %s failed (%s: %s); requests recompute what it would have "
                "served, retried every %.1f s",
                self._shown_url,
                what,
                type(exc).__name__,
                exc,
                self.retry_s,
            )

    def _succeeded(self) -> None:
        if self._outage_logged:
            with self._lock:
                was, self._outage_logged = self._outage_logged, False
            if was:
                log.warning("remote KV tier %s: answering again", self._shown_url)

    def key(self, block_hash: BlockHash) -> str:
        return key(self.key_prefix, self.tag, block_hash)

    # -- writes (step thread hands over, writer thread sends) ----------------------------------
    def room(self) -> int:
        """Stores `store` would take now (0 when the queue is full or the store is down)."""
        if not self.available:
            return 0
        with self._lock:
            return max(0, self.max_queued - self._queued)

    def store(self, block_hash: BlockHash, payload: torch.Tensor, ready: Ready | None) -> bool:
        """Queues a value ([payload_bytes] uint8, owned); False (nothing queued, counted) when
        the queue is full or the store is down. `ready`: the copy into `payload` is asynchronous
        and done when it synchronizes."""
        with self._lock:
            if self._queued >= self.max_queued or time.monotonic() < self._down_until:
                self.num_refused += 1
                return False
            self._queued += 1
            self._unfinished += 1
        self._queue.put(_Write(block_hash, payload, ready))
        return True

    def take_written(self) -> list[BlockHash]:
        """Hashes the store acknowledged since the last call (the step thread's events)."""
        with self._lock:
            out, self._written = self._written, []
        return out

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued value was sent or dropped (at most `timeout_s`)."""
        return wait_until_idle(self._idle, lambda: self._unfinished, timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flushes (bounded by `timeout_s`) and stops the threads; True when nothing was left."""
        done = self.flush(timeout_s)
        self._queue.put(None)
        self._writer.join(timeout=1.0)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._redis.close()
        return done

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < WRITE_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                self._send(batch)
            finally:
                with self._idle:
                    self._queued -= len(batch)
                    self._unfinished -= len(batch)
                    if not self._unfinished:
                        self._idle.notify_all()

    def _send(self, batch: list[_Write]) -> None:
        if not self.available:
            with self._lock:
                self.num_refused += len(batch)
            return
        pipe = self._redis.pipeline(transaction=False)
        for w in batch:
            if w.ready is not None:
                w.ready.synchronize()
            pipe.set(
                self.key(w.block_hash), encode(w.block_hash, w.payload, self.tag), ex=self.ttl_s
            )
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            with self._lock:
                self.num_write_errors += len(batch)
            self._failed("a write", exc)
            return
        self._succeeded()
        done: list[BlockHash] = []
        full = errors = 0
        for w, r in zip(batch, results, strict=True):
            if isinstance(r, redis.exceptions.OutOfMemoryError):
                full += 1
            elif isinstance(r, Exception):
                errors += 1
            else:
                done.append(w.block_hash)
        with self._lock:
            self._written += done
            self.num_writes += len(done)
            self.num_full += full
            self.num_write_errors += errors

    # -- lookups (lookup thread reads, step thread accepts) ------------------------------------
    def lookup(self, hashes: list[BlockHash]) -> Future[list[tuple[BlockHash, Any]]]:
        """The verified payloads of the longest run of `hashes` the store holds (every rank's
        share of each), read in the lookup thread; `accept` takes the result. Done at once with
        nothing while the store is down."""
        self.num_lookups += 1
        if not self.available or not hashes:
            self.num_skipped_lookups += bool(hashes)
            fut: Future[list[tuple[BlockHash, Any]]] = Future()
            fut.set_result([])
            return fut
        return self._reader.submit(self._read_run, list(hashes))

    def _read_run(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, Any]]:
        """(hash, [this rank's payload, then ranks 1..N-1's]) of the leading run found."""
        found: list[tuple[BlockHash, Any]] = []
        if not self.available:  # failed while this lookup was queued
            self.num_skipped_lookups += 1
            return found
        shapes = [(self.tag, self.payload_bytes), *self.peers]
        n = len(shapes)
        for start in range(0, len(hashes), READ_BATCH):
            chunk = hashes[start : start + READ_BATCH]
            pipe = self._redis.pipeline(transaction=False)
            for h in chunk:
                for tag, _ in shapes:
                    pipe.getex(key(self.key_prefix, tag, h), ex=self.ttl_s)
            try:
                values = pipe.execute()
            except redis.RedisError as exc:
                self._miss("error")
                self._failed("a lookup", exc)
                return found
            self._succeeded()
            for i, h in enumerate(chunk):
                shares = []
                for (tag, size), value in zip(shapes, values[i * n : (i + 1) * n], strict=True):
                    if value is None:
                        return found
                    try:
                        shares.append(decode(value, h, size, tag))
                    except BadValue as exc:
                        self._miss(exc.reason)
                        log.warning(
                            "remote KV tier: ignoring and deleting the value of %s (%s); it is a "
                            "miss",
                            h.hex()[:16],
                            exc,
                        )
                        self._delete(key(self.key_prefix, tag, h))
                        return found
                found.append((h, shares))
        return found

    def _miss(self, reason: str) -> None:
        with self._lock:
            self._misses[reason] += 1

    @property
    def misses(self) -> dict[str, int]:
        """A copy of the miss counts by reason (any thread)."""
        with self._lock:
            return dict(self._misses)

    def _delete(self, name: str) -> None:
        try:
            self._redis.delete(name)
        except redis.RedisError as exc:
            self._failed("a delete", exc)

    def accept(self, found: list[tuple[BlockHash, Any]]) -> None:
        """A finished lookup's payloads join the buffer (step thread): per hash a payload, or
        (a lookup's result) the list of every rank's share, this rank's first. The oldest beyond
        `buffer_blocks` are dropped (their requests recompute those blocks)."""
        buf = self._buffer
        for h, payload in found:
            if isinstance(payload, list):
                payload, peers = payload[0], payload[1:]
                if peers:
                    self._peer_shares[h] = peers
            buf[h] = payload
            buf.move_to_end(h)
        self.num_found += len(found)
        while len(buf) > self.buffer_blocks:
            old, _ = buf.popitem(last=False)
            self._peer_shares.pop(old, None)

    def peer_shares(self, block_hash: BlockHash) -> list[torch.Tensor]:
        """Ranks 1..N-1's verified shares of a buffered block, in rank order (rank 0)."""
        return self._peer_shares[block_hash]

    def drop(self, hashes: list[BlockHash]) -> None:
        """Forgets these buffered payloads (a worker, after its step loaded them)."""
        for h in hashes:
            self._buffer.pop(h, None)
            self._peer_shares.pop(h, None)

    def has(self, block_hash: BlockHash) -> bool:
        return block_hash in self._buffer

    def buffered(self, block_hash: BlockHash) -> torch.Tensor:
        """A buffered payload (the runner's load reads it)."""
        return self._buffer[block_hash]

    def loaded(self, block_hash: BlockHash) -> None:
        """The payload is planned into a device block in this step: dropped at `end_step`."""
        self._loaded.append(block_hash)

    def end_step(self) -> None:
        self.drop(self._loaded)
        self._loaded.clear()

    @property
    def num_buffered(self) -> int:
        return len(self._buffer)

    @property
    def queued(self) -> int:
        with self._lock:
            return self._queued
