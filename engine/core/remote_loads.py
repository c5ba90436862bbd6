"""Requests waiting for their remote-tier lookup (vLLM's KV connector contract, on our tiers).

When a request arrives (`start`), the blocks of its prompt past the leading run this engine holds
(device, CPU tier, disk index) are looked up in the remote tier, in the store's lookup thread.
The request is stepped over by the scheduler while the lookup runs (others step); `poll`
releases it when the lookup is done, its verified payloads in the store's buffer, so admission
finds them as remote hits and plans their loads (engine/kv/remote_tier.py). A failed, timed-out
or empty lookup releases the request all the same: it recomputes what the tier did not supply.
Only the step thread calls these.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from engine.core.sequence import Request, Sequence
from engine.kv.hashing import BlockHash
from engine.kv.manager import KVCacheManager
from engine.kv.remote_tier import RemoteTier
from engine.kv.tiers import TieredCache

POLL_WAIT_S = 0.05
"""When nothing else can run, how long `poll` blocks for a lookup to finish."""


class RemoteLoads:
    """The lookups in flight, one per waiting request."""

    def __init__(self, kv: KVCacheManager, tiers: TieredCache, remote: RemoteTier) -> None:
        self.kv = kv
        self.tiers = tiers
        self.remote = remote
        self._waits: dict[str, tuple[Request, list[BlockHash], Future[Any]]] = {}

    def __bool__(self) -> bool:
        return bool(self._waits)

    def start(self, req: Request, seq: Sequence) -> None:
        """Starts the lookup of the prompt's blocks past what this engine holds (if any)."""
        # the last token is always computed (engine/kv/manager.py's match_prefix)
        hashes = seq.block_hashes[: (len(seq.token_ids) - 1) // self.kv.block_size]
        pool, tiers = self.kv.pool, self.tiers
        local = 0
        for h in hashes:
            if pool.lookup(h) is None and not tiers.holds(h):
                break
            local += 1
        if local == len(hashes):
            return
        want = hashes[local:]
        self._waits[req.request_id] = (req, want, self.remote.prefetch(want))
        req.waiting_for_remote = True

    def poll(self, runnable: bool) -> None:
        """Releases the requests whose lookup finished; waits briefly for one when nothing else
        is `runnable`."""
        if not runnable:
            wait([f for _, _, f in self._waits.values()], POLL_WAIT_S, FIRST_COMPLETED)
        for rid, (req, want, fut) in list(self._waits.items()):
            if not fut.done():
                continue
            del self._waits[rid]
            found = [] if fut.cancelled() or fut.exception() is not None else fut.result()
            self.remote.accept(want, found)
            req.waiting_for_remote = False
