"""Chapter 7, serving: the live page in a real browser. The scenario that tests/test_ui_browser.py checks
and `make figures` photographs (figures/ch07_live_page.png):

  a server on the CPU with a pool of POOL_BLOCKS blocks, the page open in headless Chromium (Playwright
  driving Debian's `chromium`: nothing is downloaded), one request sent from the page's form — its blocks
  are held, then given back — then a burst of BURST requests of the same prompt: they share its cached
  prefix blocks (the first request's blocks are reused), outgrow the pool, and one is preempted.

Every stage is read back from the page itself (the grid's squares, the list of steps), as a learner sees it.
"""
from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import matplotlib.image
from matplotlib.figure import Figure

from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.entrypoints.server import Server

CHROMIUM = "/usr/bin/chromium"   # Debian's package (apt-get install -y chromium)
POOL_BLOCKS = 10                 # 160 tokens: six requests of 35 + 20 tokens need 14 blocks, so one is preempted
FIRST_TOKENS = 24                # the first request: long enough to be seen by a page that looks 4 times a second
BURST, BURST_TOKENS = 6, 20
WAIT_MS = 300_000                # a stage may take minutes on a busy two-core CPU
VIEWPORT = {"width": 1280, "height": 900}

# The squares of the grid that a sequence holds, by index (data-owner is set on them)
OWNED = "(() => [...document.querySelectorAll('#grid > .block')].flatMap((b, i) => b.dataset.owner ? [i] : []))"


def chromium_path() -> str | None:
    """Where Chromium is, or None."""
    return shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)


def start_server(settings: EngineConfig | None = None, **server_args) -> Server:
    """The scenario's server (port 0: any free one): the default model on the CPU, a tiny pool."""
    settings = settings or EngineConfig("default", "cpu", num_blocks=POOL_BLOCKS)
    return Server(settings, "default", port=0, log_level="warning", **server_args).start()


@contextmanager
def open_page(url: str, executable: str) -> Iterator[tuple]:
    """(a Playwright page on `url` in headless Chromium, the list of the uncaught errors of its script so
    far); the browser closes on exit."""
    from playwright.sync_api import sync_playwright   # only the browser test and `make figures` need it
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            page, errors = browser.new_page(viewport=VIEWPORT), []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()


def wait_until(page, what: str, predicate: str, arg=None) -> None:
    """Wait for a JavaScript predicate on the page to hold; an AssertionError naming `what` if it never does."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try:
        page.wait_for_function(predicate, arg=arg, timeout=WAIT_MS, polling=100)
    except PlaywrightTimeout:
        raise AssertionError(f"the page never showed {what} (waited {WAIT_MS // 1000} s)") from None


def owned_blocks(page) -> list[int]:
    return page.evaluate(OWNED)


def send_from_the_form(page, count: int, max_tokens: int) -> None:
    """Send `count` requests of the form's prompt, as a learner does: "Send one", or a burst of `count`."""
    page.fill("#max-tokens", str(max_tokens))
    if count == 1:
        return page.click("#send-one")
    page.fill("#burst-size", str(count))
    page.click("#send-burst")


def all_done(count: int) -> str:
    return f"() => document.querySelector('#send-status').textContent.startsWith('{count} of {count} done')"


def watch_a_burst(page, pool_blocks: int = POOL_BLOCKS) -> dict:
    """The scenario, on a page already open. Returns what the page showed: the blocks the first request
    held, those the burst held when it reused them, the preemptions counted, and two screenshots (PNG)."""
    wait_until(page, f"a pool of {pool_blocks} free blocks",
               "n => [...document.querySelectorAll('#grid > .block')].filter(b => b.matches('.free')).length === n",
               pool_blocks)
    send_from_the_form(page, 1, FIRST_TOKENS)
    wait_until(page, "a block held by the first request", f"() => {OWNED}().length > 0")
    first, one_request = owned_blocks(page), page.screenshot(full_page=True)
    wait_until(page, "the first request's blocks given back", f"() => ({all_done(1)})() && {OWNED}().length === 0")
    send_from_the_form(page, BURST, BURST_TOKENS)
    wait_until(page, "a block of the first request held again by the burst",
               f"first => {OWNED}().some(b => first.includes(b))", first)
    reused = owned_blocks(page)
    wait_until(page, "a preemption in the list of steps",
               "() => document.querySelector('#steps li.preempted') !== null")
    preemptions, burst = int(page.inner_text("#preemptions")), page.screenshot(full_page=True)
    wait_until(page, f"all {BURST} requests done and every block given back",
               f"() => ({all_done(BURST)})() && {OWNED}().length === 0")
    return {"first": first, "reused": reused, "preemptions": preemptions,
            "screenshots": {"one_request": one_request, "burst": burst}}


def photograph() -> bytes:
    """The figure: the page during the burst, a preemption in its list of steps (a PNG)."""
    executable = chromium_path()
    if executable is None:
        raise RuntimeError("figures/ch07_live_page.png is a screenshot taken in Chromium, which is not installed: "
                           "apt-get install -y chromium")
    server = start_server()
    try:
        with open_page(server.url, executable) as (page, _):
            return watch_a_burst(page)["screenshots"]["burst"]
    finally:
        server.stop()


def draw_live_page() -> Figure:
    """figures/ch07_live_page.png: the screenshot, at its own size (make figures saves at 120 dpi)."""
    image = matplotlib.image.imread(io.BytesIO(photograph()), format="png")
    height, width = image.shape[:2]
    fig = Figure(figsize=(width / 120, height / 120))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(image)
    ax.set_axis_off()
    return fig
