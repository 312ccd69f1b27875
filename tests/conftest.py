"""Shared fixtures: the grading switch (--impl), the default model, tiny random checkpoints, seeded
random generators (tests/seeding.py: the seed is printed in the header and with every failure)."""
from __future__ import annotations

import functools
import inspect
import os
import re
from typing import Callable

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from chapters.grading import IMPLS, implementation
from tests import seeding
from tinyvllm.errors import TinyVLLMError

# The tiny random-weight checkpoint several test files share: SmolLM2's (or Llama 3.2's) names, vocabulary
# and tokenizer, shrunk to 2 layers of width 64 with GQA 2:1, so that a model runs in milliseconds.
TINY_DIMS = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128)


def pytest_addoption(parser):
    parser.addoption("--impl", choices=IMPLS, default=os.environ.get("TINYVLLM_IMPL", "reference"),
                     help="grade the engine's functions (reference) or chapters/*/exercises.py (student)")


# NumPy's BLAS gets the same thread count in every test, whatever the machine and whatever ran before (importing
# torch, say): a BLAS splits a product between its threads by their number, and the split can change the last bits
BLAS_THREADS = int(os.environ.get("TINYVLLM_TEST_BLAS_THREADS", "2"))


def pytest_configure(config):
    threadpool_limits(limits=BLAS_THREADS, user_api="blas")


def pytest_runtest_setup(item):
    threadpool_limits(limits=BLAS_THREADS, user_api="blas")  # again: a library loaded since may have reset it


def pytest_report_header(config):
    return [seeding.header(), f"NumPy's BLAS: {BLAS_THREADS} threads (TINYVLLM_TEST_BLAS_THREADS)"]


def pytest_terminal_summary(terminalreporter):
    """The default mode's bitwise gaps that tests/test_batch_invariance.py measured: facts of this machine's BLAS,
    reported, not asserted (the batch-invariant mode's are asserted)."""
    facts = [value for report in terminalreporter.getreports("passed") for name, value in report.user_properties
             if name == "bitwise_gap"]
    gaps = [fact for fact in facts if "bitwise equal" not in fact]
    if facts:
        terminalreporter.write_sep("-", f"default mode, bitwise: {len(facts) - len(gaps)} of {len(facts)} "
                                        f"comparisons equal on this BLAS (within tolerance: all)")
        for gap in gaps:
            terminalreporter.write_line(f"  {gap[:200]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        section = seeding.failure_section(item)
        if section:
            report.sections.append(("random seeds", section))
    return report


@pytest.fixture
def seed(request) -> int:
    """This test's seed: the session's base seed mixed with the test's node id (tests/seeding.py)."""
    return seeding.seed_for_request(request)


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """A generator seeded with this test's seed: fresh inputs per session, the same ones on a rerun."""
    return np.random.default_rng(seed)


def describe(value) -> str:
    """An argument as a failure line shows it: an array by dtype and shape, a number or string by value, an object
    by its type."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array {value.shape}"
    if isinstance(value, (bool, int, float, str, np.generic)) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, (list, tuple)):
        short = len(value) <= 4  # a rank per element (chapter 9), a few ids: each is worth seeing
        return "[" + ", ".join(map(describe, value)) + "]" if short else f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def naming_its_input(name: str, function: Callable) -> Callable:
    """`function`, but an exception escaping it (a NumPy error, an assert of its own) carries a note naming the call
    and its arguments: the grader's failure line then says which input broke it. TinyVLLMError (a refusal the
    graders may expect) and NotImplementedError (an untouched stub) pass unchanged."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (TinyVLLMError, NotImplementedError):
            raise
        except Exception as e:
            shown = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
            e.add_note(f"raised inside {name}({', '.join(shown)})")
            raise
    return call


@pytest.fixture
def impl(request):
    """impl("rms_norm") -> the function under test for this chN-marked grader (a class, such as 6.1's
    BlockManager, as it is)."""
    marks = [m.name for m in request.node.iter_markers() if re.fullmatch(r"ch\d+", m.name)]
    assert marks, "a grader using `impl` must be marked @pytest.mark.chN"
    chapter, which = int(marks[0][2:]), request.config.getoption("--impl")

    def get(name: str):
        found = implementation(chapter, name, which)
        return naming_its_input(name, found) if inspect.isfunction(found) else found
    return get


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct directory (converted once per $TINYVLLM_HOME)."""
    from tinyvllm.formats.checkpoints import default_model_dir as resolve
    return resolve()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight SmolLM2-shaped checkpoint (TINY_DIMS, seed 7), written once per session. Read-only:
    copy it before damaging it."""
    from tinyvllm.formats.checkpoints import synth_model
    return synth_model("smollm2-135m", tmp_path_factory.mktemp("tiny") / "smollm2", seed=7, **TINY_DIMS)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """The same, shaped like Llama 3.2 (its 128k vocabulary, llama3 RoPE scaling, tiktoken tokenizer), seed 3."""
    from tinyvllm.formats.checkpoints import synth_model
    return synth_model("llama-3.2-1b", tmp_path_factory.mktemp("tiny") / "llama", seed=3, **TINY_DIMS)
