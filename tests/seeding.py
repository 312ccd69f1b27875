"""Seeds for the tests' random inputs: fresh each session, reproducible, printed when a test fails.

The session's base seed is $TINYVLLM_TEST_SEED, or, when that is unset, drawn once per session (pytest's
header line says which). Each test's seed mixes the base seed with the test's node id, so a test draws
the same inputs whichever tests run around it and in whatever order, and rerunning one failing test with
TINYVLLM_TEST_SEED=<base> draws exactly what it drew in the failing run.

Tests take the `rng` (a seeded np.random.Generator) or `seed` (its int) fixture from tests/conftest.py;
a fixture wider than a test calls seed_for_request(request) (recorded, and printed with any failure below it).
"""
from __future__ import annotations

import os
import secrets
import zlib

import numpy as np
import pytest

ENV = "TINYVLLM_TEST_SEED"


def _base_seed() -> tuple[int, bool]:
    """(base seed, whether it was pinned by the environment)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return secrets.randbits(32), False
    try:
        return int(value, 0) % 2**32, True
    except ValueError:
        raise pytest.UsageError(f"{ENV}={value!r} is not an integer") from None


BASE_SEED, PINNED = _base_seed()
SEEDS = pytest.StashKey[list]()  # on a test, module or session node: [(label, seed), ...] drawn for it


def seed_for(key: str, base: int | None = None) -> int:
    """A 32-bit seed for `key` (a node id), mixed with the base seed by NumPy's SeedSequence."""
    base = BASE_SEED if base is None else base
    return int(np.random.SeedSequence([base, zlib.crc32(key.encode())]).generate_state(1)[0])


def seed_for_request(request: pytest.FixtureRequest, label: str | None = None) -> int:
    """The seed of the node a fixture serves (a test, or a module for a module-scoped fixture), recorded
    on that node so that a failing test below it prints it."""
    node = request.node
    key = node.nodeid if label is None else f"{node.nodeid}::{label}"
    seed = seed_for(key)
    node.stash.setdefault(SEEDS, []).append((label or request.fixturename, seed))
    return seed


def header() -> str:
    how = f"from ${ENV}" if PINNED else f"drawn for this session; rerun with {ENV}={BASE_SEED} to repeat it"
    return f"random seed: {BASE_SEED} ({how})"


def failure_section(item: pytest.Item) -> str | None:
    """What a failing test's report shows: every seed drawn for it or the fixtures above it, and how to rerun."""
    drawn = [(node, label, seed) for node in item.listchain() for label, seed in node.stash.get(SEEDS, [])]
    if not drawn:
        return None
    lines = [f"{label}: {seed}" + ("" if node is item else f" (drawn once for {node.nodeid or 'the session'})")
             for node, label, seed in drawn]
    lines.append(f"base seed {BASE_SEED}; rerun: {ENV}={BASE_SEED} python -m pytest '{item.nodeid}'")
    return "\n".join(lines)
