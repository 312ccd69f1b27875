"""Chapter 7: prefix caching — a full block computed once serves every request whose prompt starts the same way.

A full block's K/V depend on its 16 tokens AND on everything before them, so a block is named by
a hash of (the previous block's hash, its 16 token ids): equal chains mean equal prefixes, and the
chain of hashes of a new prompt finds how many of its leading blocks already sit in the pool.
Those are shared (reference count + 1) instead of recomputed; prefill runs only on the tail.
A hash only points at a candidate: a hit is a block whose 16 token ids, and whose parent block, are
the prompt's — two different prefixes whose hashes collide never share K/V.

Each block is hashed once, when it fills: a sequence keeps the chain of its full blocks' hashes and
extends it (a prompt's lookup hashes the prompt once more, at admission). A cached block nobody uses any
more is not freed at once: it waits, least recently used first, in case another request wants it, and
is evicted only when a free block is needed.
"""
from __future__ import annotations

from collections import OrderedDict

from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.model.step_plan import BLOCK_SIZE, blocks_for


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The name of a full block: its tokens, chained to the name of the block before it."""
    return hash((parent, tokens))


def chain_hashes(token_ids: list[int], first: int = 0, parent: int | None = None) -> list[int]:
    """The chained hashes of full blocks first, first + 1, ... of a token sequence (parent: block first - 1's)."""
    hashes = []
    for start in range(first * BLOCK_SIZE, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = block_hash(parent, tuple(token_ids[start:start + BLOCK_SIZE]))
        hashes.append(parent)
    return hashes


class PrefixCachingBlockManager(BlockManager):
    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.cached: dict[int, int] = {}             # block hash -> physical block holding those K/V
        self.hash_of: dict[int, int] = {}            # physical block -> its hash (the reverse map)
        self.content: dict[int, tuple] = {}          # physical block -> (its parent block, its 16 token ids)
        self.chains: dict[int, list[int]] = {}       # sequence -> hashes of its full blocks so far
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused blocks: oldest use first
        self.hits = self.queries = 0                 # prompt blocks found in the cache / looked up

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """The cached blocks a new prompt can share: its leading full blocks found by hash, their tokens
        and parents checked. A full hit leaves the last block out, so prefill still has a token to compute
        (and to take logits from) and never writes into a block another sequence shares."""
        shared, parent = [], None
        for i, h in enumerate(chain_hashes(token_ids[:(len(token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE])):
            block = self.cached.get(h)
            if block is None or self.content[block] != (parent, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])):
                break                                  # not cached, or a hash collision: compute from here on
            shared.append(block)
            parent = block
        return shared

    def cached_tokens(self, token_ids: list[int]) -> int:
        return len(self.cached_prefix(token_ids)) * BLOCK_SIZE

    def blocks_to_admit(self, token_ids: list[int]) -> int:
        """Free blocks a new prompt takes: its uncached tail, plus cached blocks that were evictable
        (they count as free now and will not be once shared)."""
        shared = self.cached_prefix(token_ids)
        reviving = sum(self.ref_counts[b] == 0 for b in shared)
        return blocks_for(len(token_ids)) - len(shared) + reviving

    def admit(self, seq: int, token_ids: list[int]) -> int:
        """Start a sequence on the cached blocks of its prefix; returns how many of its tokens they hold."""
        shared = self.cached_prefix(token_ids)
        self.queries += len(token_ids) // BLOCK_SIZE
        self.hits += len(shared)
        for block in shared:
            if self.ref_counts[block] == 0:
                del self.evictable[block]              # back in use: no longer a candidate for eviction
            self.ref_counts[block] += 1
        self.tables[seq], self.lengths[seq] = shared, len(shared) * BLOCK_SIZE
        self.chains[seq] = [self.hash_of[b] for b in shared]
        return self.lengths[seq]

    def cache_full_blocks(self, seq: int, token_ids: list[int]) -> None:
        """Name the sequence's blocks that filled since the last call, so later prompts can find them."""
        chain, table = self.chains.setdefault(seq, []), self.tables[seq]
        new = chain_hashes(token_ids[:self.lengths[seq]], len(chain), chain[-1] if chain else None)
        for i, h in enumerate(new, start=len(chain)):
            block = table[i]
            if block not in self.hash_of and h not in self.cached:
                self.cached[h], self.hash_of[block] = block, h
                self.content[block] = (table[i - 1] if i else None, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
        chain += new

    def free(self, seq: int) -> None:
        for block in self.tables.pop(seq):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:            # a cached block waits; an anonymous one is free
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        del self.lengths[seq]
        self.chains.pop(seq, None)

    def _take(self) -> int:
        if not self.free_blocks:                       # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)], self.content[block]
            self.free_blocks.append(block)
        return super()._take()
