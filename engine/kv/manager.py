"""The prefix-caching KV cache manager: per-sequence block tables over a device `BlockPool`.

Pure Python on integer block ids. It decides which blocks a sequence uses, shares, caches and
frees, and returns copy plans (`KVPlan`) that the runner carries out before the next forward.

Rules:
- `match_prefix` finds the longest run of cached full blocks, device tier first, then the lower
  tiers (CPU, disk) when present; it never covers the whole sequence: the last token is always
  computed, so the sampler has logits to work with.
- `allocate` is all or nothing: it either takes every block the step needs or changes nothing.
- A sequence's blocks are freed tail first (see `BlockPool` for the eviction order).
- A partly filled block shared by forked samples is copied on write by whichever sample
  appends to it while it is still shared.
- With an event buffer (`events`), every hash the device pool starts or stops holding is
  reported (engine/kv/events.py): `BlockStored(device)` with parent hash and token ids when
  blocks are registered (computed, or fetched from a lower tier), `BlockRemoved(device)` when a
  cached block is reused for other data. The work is per block registered or evicted, never per
  token or per pool block.

Sliding window (`sliding_window=W`, given only when every layer of the model slides): a query at
position p sees keys p - W < k <= p, so before a step that computes positions [c, c + n) no query
can see a key below c - W + 1. The leading blocks wholly below it, (c - W + 1) // block_size of
them, are released as the sequence advances (`allocate`): freed to the pool's LRU queue with their
hashes, so the prefix cache still finds them until they are reused. Their table entries become
None (`block_ids` shows NULL_BLOCK_ID): attention never reads them. A prefix match then needs
only the blocks the next query's window reaches: blocks before them may be missing from every
tier (`match_prefix`; a hit on a later block's hash proves the whole prefix, as hashes chain).
A model with any full-attention layer keeps every block (no `sliding_window`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.kv.block_pool import Block, BlockPool
from engine.kv.counters import TierCounters
from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan


class SeqLike(Protocol):
    """What the manager reads of a sequence (engine.core.sequence.Sequence satisfies it)."""

    seq_id: int
    token_ids: list[int]
    block_hashes: list[BlockHash]
    num_computed_tokens: int
    num_cached_blocks: int


class LowerTiers(Protocol):
    """The CPU and disk tiers below the device pool (engine/kv/tiers.py)."""

    def find(self, block_hash: BlockHash) -> str | None:
        """The tier ("cpu", "disk" or "remote") that holds this hash, or None.

        Changes no block table; a hit stays fetchable until `end_step` (the tier holds it).
        """
        ...

    def fetch(self, block_hash: BlockHash, dst_block_id: int, plan: KVPlan) -> None:
        """Plans the copy of a found block into a device block (swap-in or disk load)."""
        ...

    def on_device_evict(self, block_id: int, block_hash: BlockHash, plan: KVPlan) -> None:
        """A cached device block is about to be reused: plan its spill if worth keeping."""
        ...

    def end_step(self) -> None:
        """The runner has carried out the step's plan: release the step's transient references."""
        ...

    def on_cached(self, block_hash: BlockHash) -> None:
        """A newly computed full device block was registered under this hash (write policies)."""
        ...

    @property
    def counters(self) -> TierCounters:
        """The tiers' counters; the manager adds its lookups to them."""
        ...

    def note_hits(self, hashes: list[BlockHash]) -> None:
        """An admitted prompt hit these cached hashes, in any tier (write policies)."""
        ...


NULL_BLOCK_ID = 0
"""What `block_ids` shows for a block released out of the sliding window: a placeholder that
attention never reads (the kernels skip it, the torch reference masks it)."""


@dataclass(slots=True)
class PrefixMatch:
    device_blocks: list[Block] = field(default_factory=list)
    """Cached device blocks of the prefix, in order (after the skipped ones)."""
    lower_hits: list[tuple[str, BlockHash]] = field(default_factory=list)
    """(tier, hash) of the blocks after the device hits that a lower tier holds, in order."""
    block_size: int = 16
    num_skipped: int = 0
    """Leading blocks of the prefix outside the next query's sliding window: matched (a later
    block's hash proves them) but neither held nor fetched."""

    @property
    def num_blocks(self) -> int:
        return self.num_skipped + len(self.device_blocks) + len(self.lower_hits)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def tokens_by_tier(self) -> dict[str, int]:
        """Cached tokens per tier; skipped blocks count for the tier of the first held one."""
        out = {
            "device": len(self.device_blocks) * self.block_size,
            "cpu": 0,
            "disk": 0,
            "remote": 0,
        }
        for tier, _ in self.lower_hits:
            out[tier] += self.block_size
        first = "device" if self.device_blocks or not self.lower_hits else self.lower_hits[0][0]
        out[first] += self.num_skipped * self.block_size
        return out


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        max_pinned_fraction: float = 0.5,
        tiers: LowerTiers | None = None,
        events: KVEventBuffer | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        """Set when every layer slides (the largest window): blocks outside it are released."""
        self.events = events
        """Where device-tier stores and removals are reported (None: nowhere)."""
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, on_evict=self._on_evict)
        self.tiers = tiers
        self.tables: dict[int, list[Block | None]] = {}
        """seq_id -> its blocks in order; None for a block released out of the window."""
        self.num_released: dict[int, int] = {}
        """seq_id -> its leading table entries released (None), when any."""
        self._ids: dict[int, list[int]] = {}
        """seq_id -> `block_ids`' last answer, until the table changes (allocate, free)."""
        self.plan = KVPlan()
        """Copies accumulated since the last `take_plan`."""
        self.counters = tiers.counters if tiers is not None else TierCounters()
        """One set for the whole cache: lookups counted here, copies by the lower tiers."""
        self.max_pinned = int(max_pinned_fraction * num_blocks)
        self.pins: dict[int, float] = {}
        """block_id -> expiry time of its pin (a pin holds one reference)."""

    # -- lookups -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, seq_id: int) -> list[int]:
        """The sequence's block table (NULL_BLOCK_ID for released entries). Read only: the same
        list comes back until the table changes, so a caller may keep a copy of its rows and
        tell a changed table by identity (engine/worker/input_batch.py)."""
        ids = self._ids.get(seq_id)
        if ids is None:
            table = self.tables.get(seq_id, ())
            ids = [NULL_BLOCK_ID if b is None else b.block_id for b in table]
            self._ids[seq_id] = ids
        return ids

    def num_held_blocks(self, seq_id: int) -> int:
        """Blocks the sequence holds a reference on (its table less released entries)."""
        table = self.tables.get(seq_id, ())
        return len(table) - self.num_released.get(seq_id, 0)

    def num_outside_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query of a step starting at position `num_computed_tokens` can see:
        those wholly below num_computed_tokens - W + 1 (0 without a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def match_prefix(self, seq: SeqLike) -> PrefixMatch:
        """Longest cached prefix of the sequence's tokens (never all of them). Changes nothing."""
        match = PrefixMatch(block_size=self.block_size)
        if not self.enable_caching:
            return match
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hashes = seq.block_hashes[:max_blocks]
        first, i = self._device_run(hashes)
        match.device_blocks = [b for b in map(self.pool.lookup, hashes[first:i]) if b is not None]
        if self.tiers is not None:
            for h in hashes[i:]:
                tier = self.tiers.find(h)
                if tier is None:
                    break
                match.lower_hits.append((tier, h))
        # Keep only what the next query's window reaches: blocks [skip, end) of the prefix.
        end = i + len(match.lower_hits)
        skip = max(first, self.num_outside_window(end * self.block_size))
        match.num_skipped = skip
        del match.device_blocks[: max(0, skip - first)]
        del match.lower_hits[: max(0, skip - i)]
        return match

    def _device_run(self, hashes: list[BlockHash]) -> tuple[int, int]:
        """(first, end): the longest prefix of `end` blocks whose blocks [first, end) are cached on
        the device; first is 0 without a sliding window, else the blocks the window leaves out.

        With a window, blocks before `first` need not be cached anywhere: the hash of block
        end - 1 chains over all of them. One dict lookup per prompt block.
        """
        runs: list[int] = []  # runs[j]: cached device blocks ending at block j
        run = 0
        for h in hashes:
            if self.pool.lookup(h) is None:
                if self.sliding_window is None:
                    break
                run = 0
            else:
                run += 1
            runs.append(run)
        if self.sliding_window is None:
            return 0, run
        for end in range(len(runs), 0, -1):
            first = self.num_outside_window(end * self.block_size)
            if runs[end - 1] >= end - first:
                return first, end
        return 0, 0

    def record_admission(self, num_prompt_tokens: int, match: PrefixMatch) -> None:
        """Counts one admitted prompt's lookup (queries and hits in tokens, per tier)."""
        by_tier = match.tokens_by_tier()
        if self.tiers is not None and match.num_blocks:
            hit = [b.block_hash for b in match.device_blocks if b.block_hash is not None]
            self.tiers.note_hits(hit + [h for _, h in match.lower_hits])
        c = self.counters
        c.device_queries += num_prompt_tokens
        c.device_hits += by_tier["device"]
        if self.tiers is not None:
            c.cpu_queries += num_prompt_tokens - by_tier["device"]
            c.cpu_hits += by_tier["cpu"]
            c.disk_queries += num_prompt_tokens - by_tier["device"] - by_tier["cpu"]
            c.disk_hits += by_tier["disk"]
            c.remote_queries += num_prompt_tokens - sum(
                by_tier[t] for t in ("device", "cpu", "disk")
            )
            c.remote_hits += by_tier["remote"]

    # -- allocation ----------------------------------------------------------------------------
    def blocks_needed(self, seq: SeqLike, num_new_tokens: int, match: PrefixMatch | None) -> int:
        """Free blocks `allocate` would consume (new blocks, copy-on-write, free hit blocks)."""
        table = self.tables.get(seq.seq_id, [])
        computed = seq.num_computed_tokens + (match.num_tokens if match else 0)
        total = -(-(computed + num_new_tokens) // self.block_size)
        # NOTE: lower-tier hits are copied into new device blocks: they count as needed.
        # Released (None) and skipped entries take no block but count as table positions.
        held = len(table) + (match.num_skipped + len(match.device_blocks) if match else 0)
        need = max(0, total - held)
        if match:
            need += sum(1 for b in match.device_blocks if b.ref_cnt == 0)
        if self._needs_cow(table, seq.num_computed_tokens, num_new_tokens):
            need += 1
        return need

    def _needs_cow(self, table: list[Block | None], num_computed: int, num_new: int) -> bool:
        if not table or num_new == 0 or num_computed % self.block_size == 0:
            return False
        last = table[(num_computed - 1) // self.block_size]
        return last is not None and last.ref_cnt > 1

    def fits_in_place(self, seq: SeqLike) -> bool:
        """Whether one more token of `seq` goes into a block it already holds alone: `allocate(seq,
        1)` would take no block, copy none and release none (the decode step's common case)."""
        pos = seq.num_computed_tokens  # the new token's position
        if pos % self.block_size == 0 or self.sliding_window is not None:
            return False
        table = self.tables.get(seq.seq_id)
        if table is None or len(table) <= pos // self.block_size:
            return False
        last = table[pos // self.block_size]
        return last is not None and last.ref_cnt == 1

    def allocate(self, seq: SeqLike, num_new_tokens: int, match: PrefixMatch | None = None) -> bool:
        """Gives the sequence room for `num_new_tokens` more tokens (after a prefix match).

        All or nothing: returns False and changes nothing when the pool is short, but for the
        release of blocks that fell out of the sliding window (always due, whatever follows).
        """
        self._ids.pop(seq.seq_id, None)  # the table may change below
        self._release_outside_window(seq)
        if self.blocks_needed(seq, num_new_tokens, match) > self.pool.num_free:
            return False
        table = self.tables.setdefault(seq.seq_id, [])
        if match is not None and match.num_blocks:
            assert not table, "a prefix match applies to a sequence without blocks"
            table.extend([None] * match.num_skipped)
            if match.num_skipped:
                self.num_released[seq.seq_id] = match.num_skipped
            self.pool.touch(match.device_blocks)
            table.extend(match.device_blocks)
            if match.lower_hits:
                assert self.tiers is not None
                fetched = self.pool.allocate(len(match.lower_hits))
                for blk, (_, h) in zip(fetched, match.lower_hits, strict=True):
                    self.tiers.fetch(h, blk.block_id, self.plan)
                    self.pool.cache(blk, h)
                table.extend(fetched)
                if self.events is not None:
                    start = match.num_skipped + len(match.device_blocks)
                    self._report_stored(seq, start, start + len(fetched))
            seq.num_computed_tokens = match.num_tokens
            seq.num_cached_blocks = match.num_blocks
        if self._needs_cow(table, seq.num_computed_tokens, num_new_tokens):
            i = (seq.num_computed_tokens - 1) // self.block_size
            old = table[i]
            assert old is not None  # _needs_cow
            (new,) = self.pool.allocate(1)
            self.plan.cow.append((old.block_id, new.block_id))
            table[i] = new
            self.pool.free([old])
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        if total > len(table):
            table.extend(self.pool.allocate(total - len(table)))
        return True

    def _release_outside_window(self, seq: SeqLike) -> None:
        """Frees the sequence's leading blocks that no later query can see (sliding window),
        tail first; their entries become None. O(blocks released)."""
        table = self.tables.get(seq.seq_id)
        if table is None or self.sliding_window is None:
            return
        done = self.num_released.get(seq.seq_id, 0)
        upto = min(self.num_outside_window(seq.num_computed_tokens), len(table))
        if upto <= done:
            return
        released = [b for b in table[done:upto] if b is not None]
        table[done:upto] = [None] * (upto - done)
        self.num_released[seq.seq_id] = upto
        self.pool.free(reversed(released))

    def cache_blocks(self, seq: SeqLike) -> None:
        """Registers the sequence's newly full, computed blocks in the prefix cache."""
        if not self.enable_caching or seq.num_computed_tokens < self.block_size * (
            seq.num_cached_blocks + 1
        ):
            return  # no new full block
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        run = -1  # first block of the current run of newly registered blocks (events)
        for i in range(seq.num_cached_blocks, n_full):
            block = table[i]
            new = block is not None and block.block_hash is None
            if block is not None and self.pool.cache(block, seq.block_hashes[i]) and new:
                if self.tiers is not None:
                    self.tiers.on_cached(seq.block_hashes[i])
                if run < 0:
                    run = i
            elif run >= 0:
                self._report_stored(seq, run, i)
                run = -1
        if run >= 0:
            self._report_stored(seq, run, n_full)
        seq.num_cached_blocks = max(seq.num_cached_blocks, n_full)

    def _report_stored(self, seq: SeqLike, start: int, end: int) -> None:
        """BlockStored(device) for the sequence's blocks [start, end), newly registered."""
        if self.events is None:
            return
        bs = self.block_size
        parent = seq.block_hashes[start - 1] if start > 0 else None
        self.events.stored(
            seq.block_hashes[start:end], parent, seq.token_ids[start * bs : end * bs], "device"
        )

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        """The child shares every block of the parent (copy-on-write on the partial tail)."""
        blocks = self.tables[parent.seq_id]
        self.pool.touch(b for b in blocks if b is not None)
        self.tables[child.seq_id] = list(blocks)
        self._ids.pop(child.seq_id, None)
        if parent.seq_id in self.num_released:
            self.num_released[child.seq_id] = self.num_released[parent.seq_id]
        child.num_cached_blocks = parent.num_cached_blocks

    def free(self, seq: SeqLike) -> None:
        """Releases the sequence's blocks, tail first; cached ones stay findable until reused."""
        blocks = self.tables.pop(seq.seq_id, None)
        self.num_released.pop(seq.seq_id, None)
        self._ids.pop(seq.seq_id, None)
        if blocks:
            self.pool.free(b for b in reversed(blocks) if b is not None)

    def take_plan(self) -> KVPlan:
        plan, self.plan = self.plan, KVPlan()
        return plan

    def end_step(self) -> None:
        if self.tiers is not None:
            self.tiers.end_step()

    def _on_evict(self, block: Block, block_hash: BlockHash) -> None:
        if block.block_id in self.pins:
            raise AssertionError(f"pinned {block} reached the free queue")
        if self.events is not None:
            self.events.removed(block_hash, "device")
        if self.tiers is not None:
            self.tiers.on_device_evict(block.block_id, block_hash, self.plan)

    # -- pinning -------------------------------------------------------------------------------
    def pin(self, seq: SeqLike, num_tokens: int, until: float) -> bool:
        """Keeps the sequence's first full blocks covering `num_tokens` out of eviction until `until`.

        Returns False (and pins nothing) when that would exceed the pinned-block cap. A sequence
        that holds no blocks now (preempted while its first token was in flight: async
        scheduling) pins the cached blocks of its hashes, as far as they run without a gap (what
        a prefix match could use).
        """
        n_full = num_tokens // self.block_size
        table = self.tables.get(seq.seq_id)
        found: list[Block | None] = []
        if table is None:
            for h in seq.block_hashes[:n_full]:
                block = self.pool.lookup(h)
                if block is None:
                    break
                found.append(block)
        else:
            found = table[:n_full]
        blocks = [b for b in found if b is not None and b.block_hash is not None]
        new = [b for b in blocks if b.block_id not in self.pins]
        if len(self.pins) + len(new) > self.max_pinned:
            return False
        self.pool.touch(new)
        for b in blocks:
            self.pins[b.block_id] = max(until, self.pins.get(b.block_id, 0.0))
        return True

    def expire_pins(self, now: float) -> None:
        expired = [bid for bid, t in self.pins.items() if t <= now]
        for bid in expired:
            del self.pins[bid]
        self.pool.free(self.pool.blocks[bid] for bid in expired)

    def reset(self) -> bool:
        """Drops every cached hash (only when no sequence holds blocks). Returns success."""
        self.expire_pins(float("inf"))
        dropped = list(self.pool.cached) if self.events is not None else []
        if not self.pool.reset():
            return False
        if self.events is not None:
            self.events.removed_many(dropped, "device")
        return True

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for seq_id, blocks in self.tables.items():
            released = self.num_released.get(seq_id, 0)
            if any(b is None for b in blocks[released:]) or any(blocks[:released]):
                raise AssertionError(f"seq {seq_id}: released entries are not its first {released}")
            for b in blocks[released:]:
                assert b is not None
                refs[b.block_id] += 1
        for bid in self.pins:
            refs[bid] += 1
        for b in self.pool.blocks:
            if refs[b.block_id] != b.ref_cnt:
                raise AssertionError(f"{b} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} holders")
