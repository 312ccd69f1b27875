"""Chapter 11: a set of characters as byte sequences — UTF-8 range splitting (as RE2 and Rust's regex do).

A character class such as [^"\\] holds about 1.1 million code points. Spelled as bytes it is a handful of
byte-range sequences: [00-21] | [23-5B] | ... | [C2-DF][80-BF] | E0[A0-BF][80-BF] | ... A range of code
points with the same encoded length is split until each piece is a product of byte ranges, one per byte.
"""
from __future__ import annotations

from tinyvllm.engine.structured.regex_ast import Node, alt, byte_range, seq

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)                    # not characters: UTF-8 cannot encode them
LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT)   # the last code point of each encoded length


def characters(ranges: list[tuple[int, int]]) -> Node:
    """One character from the code point ranges (inclusive), as UTF-8 byte sequences."""
    pieces = []
    for low, high in valid(ranges):
        for start, end in split_by_length(low, high):
            pieces += [seq(*(byte_range(a, b) for a, b in byte_ranges)) for byte_ranges in utf8_ranges(start, end)]
    return alt(*pieces)


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every code point not in the ranges."""
    out, next_free = [], 0
    for low, high in sorted(ranges):
        if low > next_free:
            out.append((next_free, low - 1))
        next_free = max(next_free, high + 1)
    if next_free <= MAX_CODE_POINT:
        out.append((next_free, MAX_CODE_POINT))
    return out


def valid(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges without the surrogates, cut to pieces that do not straddle them."""
    low_s, high_s = SURROGATES
    out = []
    for low, high in ranges:
        out += [(a, b) for a, b in ((low, min(high, low_s - 1)), (max(low, high_s + 1), high)) if a <= b]
    return out


def split_by_length(low: int, high: int) -> list[tuple[int, int]]:
    """[low, high] cut where the UTF-8 length changes (1, 2, 3, 4 bytes)."""
    out, start = [], low
    for limit in LENGTH_LIMITS:
        if start <= min(high, limit):
            out.append((start, min(high, limit)))
            start = limit + 1
    return out


def utf8_ranges(low: int, high: int) -> list[list[tuple[int, int]]]:
    """[low, high] (one encoded length) as sequences of byte ranges. Split until the encodings of low and
    high differ only in bytes where low has every continuation bit 0 and high every one 1."""
    if low > high:
        return []
    for i in range(1, len(chr(low).encode())):
        tail = (1 << (6 * i)) - 1                  # the bits of the last i bytes
        if low & ~tail != high & ~tail:
            if low & tail != 0:                    # low starts mid-block: its block alone, then the rest
                return utf8_ranges(low, low | tail) + utf8_ranges((low | tail) + 1, high)
            if high & tail != tail:                # high ends mid-block: the rest, then its block alone
                return utf8_ranges(low, (high & ~tail) - 1) + utf8_ranges(high & ~tail, high)
    return [list(zip(chr(low).encode(), chr(high).encode()))]
