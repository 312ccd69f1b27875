"""The live page (`serve`, at /) in a real browser: headless Chromium driven by Playwright.

- the scenario of chapters/ch07_batching/live_page.py on the default model, pool of 10 blocks: one request
  from the page's form holds blocks, gives them back; a burst of six of the same prompt reuses them (its
  prefix is cached), outgrows the pool, and a preemption shows in the list of steps; at the end every
  block is back. Its screenshots are written to the test's tmp_path (`make figures` takes the same one
  for figures/ch07_live_page.png);
- with --api-key the page asks for the key, then goes live, and its form's requests carry the key.

Chromium is Debian's (apt-get install -y chromium; .ci/run installs it): Playwright never downloads a
browser here. Without it this file is skipped, with the reason, unless TINYVLLM_REQUIRE_BROWSER is set
(CI sets it): then a missing browser fails.
"""
from __future__ import annotations

import os

import pytest

from chapters.ch07_batching import live_page
from tinyvllm.engine.engine_config import EngineConfig

pytestmark = pytest.mark.slow   # not in make test-fast: a headless browser against a served engine


@pytest.fixture(scope="module")
def chromium() -> str:
    path = live_page.chromium_path()
    if path is None:
        reason = "the live page is tested in Chromium, which is not installed (apt-get install -y chromium)"
        if os.environ.get("TINYVLLM_REQUIRE_BROWSER"):
            pytest.fail(f"{reason}; TINYVLLM_REQUIRE_BROWSER is set, so this must not be skipped")
        pytest.skip(reason)
    return path


def test_blocks_are_held_freed_reused_and_a_preemption_shows(chromium, tmp_path):
    server = live_page.start_server()
    try:
        with live_page.open_page(server.url, chromium) as (page, errors):
            seen = live_page.watch_a_burst(page)
            assert page.inner_text("#model") == "default on cpu"
        for name, png in seen["screenshots"].items():
            (tmp_path / f"live_page_{name}.png").write_bytes(png)
        assert seen["first"], "the first request held no block"
        assert set(seen["reused"]) & set(seen["first"]), "the burst reused none of the first request's blocks"
        assert seen["preemptions"] > 0
        assert not errors, f"the page's script failed: {errors}"
        stats = server.engine.client.stats
        assert stats.free_blocks == stats.num_blocks == live_page.POOL_BLOCKS and stats.running == stats.waiting == 0
    finally:
        server.stop()


def test_the_page_asks_for_the_api_key_and_sends_it(chromium, tiny_model_dir):
    server = live_page.start_server(EngineConfig(str(tiny_model_dir), "cpu", num_blocks=8), api_key="sesame")
    try:
        with live_page.open_page(server.url, chromium) as (page, errors):
            page.wait_for_selector("#key-form:not([hidden])", timeout=60_000)
            assert "API key" in page.inner_text("#status")
            page.fill("#key", "sesame")
            page.click("#key-form button")
            live_page.wait_until(page, "the grid, once the key was given",
                                 "() => document.querySelectorAll('#grid > .block.free').length === 8")
            page.fill("#max-tokens", "4")
            page.click("#send-one")
            live_page.wait_until(page, "the reply", live_page.all_done(1))
            assert page.inner_text("#replies li").split()[1] == "length:"
            assert page.inner_text("#status") == "live" and not errors
    finally:
        server.stop()
