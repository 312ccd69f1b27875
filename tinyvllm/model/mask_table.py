"""Chapter 11: the structured outputs' token masks, kept where the logits are.

A constraint's mask depends on its automaton's state only, and the engine computes it once per state
(engine/structured/token_dfa.py hands back the same host array whenever the state recurs). Sent as it is,
a batch of 64 constrained sequences would stack and copy 64 x vocab booleans to the GPU every step (3 MB for
SmolLM2's 49,152 tokens) — more than the step's sampling costs. So each mask crosses once: it gets a row of a
(MASK_TABLE_ROWS, vocab) table on the device the first time it is used, and a step sends only the row numbers
of its masks and gathers them there. Least recently used rows are reused when the table is full.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

# Distinct masks kept on the device: a JSON schema's automaton has tens to hundreds of states in use; 512 rows of
# Llama 3's 128,256 tokens are 66 MB. A step that needs more distinct masks than this sends them whole.
MASK_TABLE_ROWS = 512


class MaskTable:
    def __init__(self, rows: int = MASK_TABLE_ROWS):
        self.capacity = rows
        self.table = None                                              # (rows, vocab) bool, where the logits are
        self.rows: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()   # id(mask) -> (mask, its row): LRU first
        self.free: list[int] = []

    def gather(self, masks: list[np.ndarray], xp) -> object:
        """(len(masks), vocab) bool, an xp array (NumPy or CuPy: where the logits are): the masks' rows, each copied
        in on first use. The table keeps each host mask it holds alive, so an id() it knows always means that array."""
        if len({id(m) for m in masks}) > self.capacity:   # more than fits at once: this step sends them whole
            return xp.asarray(np.stack(masks))
        if self.table is None or self.table.shape[1] != len(masks[0]) or not isinstance(self.table, xp.ndarray):
            self.table, self.rows, self.free = xp.empty((self.capacity, len(masks[0])), bool), OrderedDict(), \
                list(range(self.capacity))
        return self.table[xp.asarray([self.row_of(mask, xp) for mask in masks], dtype=np.int32)]

    def row_of(self, mask: np.ndarray, xp) -> int:
        """mask's row in the table, copied in if it is new (into a free row, or the least recently used one's)."""
        entry = self.rows.pop(id(mask), None)
        if entry is None:
            row = self.free.pop() if self.free else self.rows.popitem(last=False)[1][1]
            self.table[row] = xp.asarray(mask)
            entry = (mask, row)
        self.rows[id(mask)] = entry   # now the most recently used
        return entry[1]
