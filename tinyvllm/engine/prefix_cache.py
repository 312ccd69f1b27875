"""Chapter 7: prefix caching — a full block computed once serves every request whose prompt starts the same way.

A full block's K/V depend on its 16 tokens AND on everything before them, so a block is named by
a hash of (the previous block's hash, its 16 token ids): equal chains mean equal prefixes, and the
chain of hashes of a new prompt finds how many of its leading blocks already sit in the pool.
Those are shared (reference count + 1) instead of recomputed; prefill runs only on the tail.
A hash only points at a candidate: a hit is a block whose 16 token ids, and whose parent block, are
the prompt's — two different prefixes whose hashes collide never share K/V.

Each block of a sequence is hashed once in its life: the sequence keeps the chain of its full blocks'
hashes (seq.block_hashes), extended when a lookup or a step finds more full blocks (vLLM v1's
Request.block_hashes). A lookup per admission turns the chain into shared blocks; a head waiting for room
is looked up again at the next step, without hashing. A cached block nobody uses any more is not freed at
once: it waits, least recently used first, in case another request wants it, and is evicted only when a
free block is needed. Hits and queries are counted in tokens, at admission, in one place (stats).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tinyvllm.engine.block_manager import BlockManager, PrefixHit
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.step_plan import BLOCK_SIZE


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The name of a full block: its tokens, chained to the name of the block before it."""
    return hash((parent, tokens))


def extend_chain(chain: list[int], token_ids: list[int], num_blocks: int) -> None:
    """Hash blocks len(chain) .. num_blocks - 1 of a token sequence onto its chain, in place (each block once)."""
    parent = chain[-1] if chain else None
    for start in range(len(chain) * BLOCK_SIZE, num_blocks * BLOCK_SIZE, BLOCK_SIZE):
        parent = block_hash(parent, tuple(token_ids[start:start + BLOCK_SIZE]))
        chain.append(parent)


@dataclass
class PrefixCacheStats:
    """In tokens, counted at admission: tokens looked up, and tokens found cached (hit rate = hits / queries)."""
    queries: int = 0
    hits: int = 0


class PrefixCachingBlockManager(BlockManager):
    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.cached: dict[int, int] = {}             # block hash -> physical block holding those K/V
        self.hash_of: dict[int, int] = {}            # physical block -> its hash (the reverse map)
        self.content: dict[int, tuple] = {}          # physical block -> (its parent block, its 16 token ids)
        self.named: dict[int, int] = {}              # sequence -> how many of its blocks are in `cached`
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused blocks: oldest use first
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def lookup(self, seq) -> PrefixHit:
        """The cached blocks a new sequence can share: its leading full blocks found by hash, their tokens
        and parents checked. A full hit leaves the last block out, so prefill still has a token to compute
        (and to take logits from) and never writes into a block another sequence shares."""
        token_ids, usable = seq.token_ids, (len(seq) - 1) // BLOCK_SIZE
        extend_chain(seq.block_hashes, token_ids, usable)
        shared, parent = [], None
        for i, h in enumerate(seq.block_hashes[:usable]):
            block = self.cached.get(h)
            if block is None or self.content[block] != (parent, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])):
                break                                  # not cached, or a hash collision: compute from here on
            shared.append(block)
            parent = block
        return PrefixHit(shared, len(token_ids))

    def admit(self, seq: int, hit: PrefixHit) -> int:
        """Start a sequence on the cached blocks of its prefix; returns how many of its tokens they hold."""
        self.stats.queries += hit.queried
        self.stats.hits += hit.tokens
        for block in hit.blocks:
            if self.ref_counts[block] == 0:
                del self.evictable[block]              # back in use: no longer a candidate for eviction
            self.ref_counts[block] += 1
        self.tables[seq], self.lengths[seq] = list(hit.blocks), hit.tokens
        self.named[seq] = len(hit.blocks)
        return hit.tokens

    def cache_full_blocks(self, seq) -> None:
        """Name the sequence's (a Sequence's) blocks that filled since the last call, so later prompts find them: those
        whose tokens the host knows (with async scheduling the newest may still be on the device: a later call)."""
        table, first = self.tables[seq.seq_id], self.named.get(seq.seq_id, 0)
        full = min(self.lengths[seq.seq_id], len(seq)) // BLOCK_SIZE
        if full <= first:
            return
        token_ids = seq.token_ids
        extend_chain(seq.block_hashes, token_ids, full)
        for i in range(first, full):
            block, h = table[i], seq.block_hashes[i]
            if block not in self.hash_of and h not in self.cached:
                self.cached[h], self.hash_of[block] = block, h
                self.content[block] = (table[i - 1] if i else None, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
        self.named[seq.seq_id] = full

    def free(self, seq: int) -> None:
        super().free(seq)
        self.named.pop(seq, None)

    def truncate(self, seq: int, num_tokens: int) -> None:
        """As BlockManager's; a block named in the cache is full of kept tokens, so it is never cut (chapter 10:
        proposals are verified before their blocks are named, and the rejected ones never are)."""
        if num_tokens // BLOCK_SIZE < self.named.get(seq, 0):
            raise TinyVLLMError(f"sequence {seq}: its first {self.named[seq]} blocks are in the prefix cache; "
                                f"cannot keep only {num_tokens} tokens")
        super().truncate(seq, num_tokens)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:                # a cached block waits; an anonymous one is free
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def _take(self) -> int:
        if not self.free_blocks:                       # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)], self.content[block]
            self.free_blocks.append(block)
        return super()._take()
