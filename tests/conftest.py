"""Shared fixtures: the grading switch (--impl), the default model, tiny random checkpoints."""
from __future__ import annotations

import os
import re

import pytest

from chapters.grading import IMPLS, implementation


def pytest_addoption(parser):
    parser.addoption("--impl", choices=IMPLS, default=os.environ.get("TINYVLLM_IMPL", "reference"),
                     help="grade the engine's functions (reference) or chapters/*/exercises.py (student)")


@pytest.fixture
def impl(request):
    """impl("rms_norm") -> the function under test for this chN-marked grader."""
    marks = [m.name for m in request.node.iter_markers() if re.fullmatch(r"ch\d+", m.name)]
    assert marks, "a grader using `impl` must be marked @pytest.mark.chN"
    chapter, which = int(marks[0][2:]), request.config.getoption("--impl")
    return lambda name: implementation(chapter, name, which)


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct directory (converted once per $TINYVLLM_HOME)."""
    from tinyvllm.models import default_model_dir as resolve
    return resolve()
