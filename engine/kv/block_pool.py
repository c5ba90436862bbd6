"""A pool of KV blocks with ref counts, an O(1) LRU free queue and a hash index.

Pure Python on integer block ids; no torch. The same class serves the device tier and the CPU
tier (the CPU tier only ever holds cached blocks with ref_cnt 0 or transiently 1).

Eviction order (the contract tests assert to the exact block id):
- A block whose ref count drops to 0 is appended to the tail of the free queue; it keeps its
  hash and stays findable ("lazy eviction") until it is popped for reuse.
- `allocate` pops from the head: the least recently freed block is reused first.
- Callers free a request's blocks in reverse order (tail block first), so among one request's
  blocks the tail block, the least likely to be shared by a later prompt, is evicted first.
- A hit on a free block (`touch`) takes it out of the queue; freeing it again puts it at the tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.kv.hashing import BlockHash


class Block:
    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        """Set once the block is full and cached; cleared when the block is reused."""
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in reuse order (head = next to reuse); O(1) everything."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels, never handed out
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def popleft(self) -> Block:
        first = self._head.next
        if first is None or first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self):  # head to tail
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def __len__(self) -> int:
        return self.num_free


EvictHook = Callable[[Block, BlockHash], None]
"""Called with a cached block (and its hash) just before it is reused for other data."""


class BlockPool:
    def __init__(self, num_blocks: int, *, on_evict: EvictHook | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.on_evict = on_evict
        self.num_evictions = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out (free, cached or not)."""
        return self.free_queue.num_free

    @property
    def num_used(self) -> int:
        """Blocks with ref_cnt > 0."""
        return self.num_blocks - self.free_queue.num_free

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash)

    # -- mutations -----------------------------------------------------------------------------
    def touch(self, blocks: Iterable[Block]) -> None:
        """Takes a reference on each block (a hit), removing free ones from the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Pops n blocks in LRU order, evicting their hashes; ref_cnt of each becomes 1."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        h = b.block_hash
        assert h is not None
        if self.on_evict is not None:
            self.on_evict(b, h)
        del self.cached[h]
        b.block_hash = None
        self.num_evictions += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drops one reference per block, in the given order (pass a request's blocks tail first)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache(self, block: Block, block_hash: BlockHash) -> bool:
        """Registers a full block under its hash; False if another block already holds it."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset(self) -> bool:
        """Forgets every hash; only possible when no block is in use. Returns success."""
        if self.num_used:
            return False
        for b in self.blocks:
            if b.block_hash is not None:
                del self.cached[b.block_hash]
                b.block_hash = None
        return True

    def check_integrity(self) -> None:
        """free + in use == total, no negative refs, each block in one place, index consistent."""
        in_queue = set()
        for b in self.free_queue:
            if b.block_id in in_queue:
                raise AssertionError(f"{b} appears twice in the free queue")
            in_queue.add(b.block_id)
            if b.ref_cnt != 0:
                raise AssertionError(f"{b} is in the free queue with ref_cnt {b.ref_cnt}")
        if len(in_queue) != self.free_queue.num_free:
            raise AssertionError("free queue length counter is wrong")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise AssertionError(f"{b} has a negative ref count")
            if b.ref_cnt == 0 and b.block_id not in in_queue:
                raise AssertionError(f"{b} is unreferenced but not free")
            if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                raise AssertionError(f"{b} has a hash the index does not map to it")
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise AssertionError(f"index maps a hash to {b}, which holds another")
        if len(in_queue) + sum(1 for b in self.blocks if b.ref_cnt > 0) != self.num_blocks:
            raise AssertionError("free + in use != total")
