"""The graders can fail: run against the untouched exercise stubs, every chN grader must fail.

(If you have filled in chapters/*/exercises.py, this check fails for the exercises you solved: it
guards the course as shipped. Use `make grade CH=N` to grade your work.)
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chapters.grading import chapter_numbers, exercises

ROOT = Path(__file__).resolve().parent.parent


def _has_exercises(n: int) -> bool:
    try:
        exercises(n)
        return True
    except LookupError:
        return False


CHAPTERS = [n for n in chapter_numbers() if _has_exercises(n)]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_grader_fails_on_the_stubs(chapter):
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", f"ch{chapter}",
                          "--impl=student", "-rA", f"tests/test_ch{chapter:02d}_exercises.py"], cwd=ROOT,
                         capture_output=True, text=True)
    passed = re.findall(r"^PASSED (\S+)", run.stdout, re.M)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, re.M)
    assert not passed, f"graders that pass on the stubs: {passed}"
    assert failed, f"no chapter {chapter} grader ran:\n{run.stdout[-2000:]}"
    # every exercise of the chapter is exercised by at least one failing grader
    for name in exercises(chapter).REFERENCE:
        assert any(name in f for f in failed), f"no grader failed for exercise {name!r}"
