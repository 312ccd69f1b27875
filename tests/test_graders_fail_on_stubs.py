"""The graders can fail: run against the untouched exercise stubs, every chN grader must fail; run against
the plausible wrong answers of tests/mutants.py, each fails in its own exercise's row (and the right answers
there pass).

(If you have filled in chapters/*/exercises.py, the stubs check fails for the exercises you solved: it
guards the course as shipped. Use `make grade CH=N` to grade your work.)
"""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chapters import grade_report
from chapters.grading import chapter_numbers, exercises
from tests import mutants
from tests.conftest import naming_its_input
from tinyvllm.errors import TinyVLLMError

pytestmark = pytest.mark.slow   # not in make test-fast: every grader run on stubs and wrong answers

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


@pytest.fixture(scope="module")
def mutant_rows(tmp_path_factory) -> dict[str, list[grade_report.Row]]:
    """Every entry of tests/mutants.py graded as the student's answer (one process for all): its score rows."""
    out = tmp_path_factory.mktemp("mutants")
    run = subprocess.run([sys.executable, "-m", "tests.mutants", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return {name: grade_report.score(out / f"{index}.xml") for index, name in enumerate(mutants.MUTANTS)}


@pytest.mark.parametrize("mutant", mutants.MUTANTS)
def test_graders_fail_each_wrong_answer_in_its_own_row(mutant, mutant_rows):
    """Every plausible wrong answer loses points in its own exercise's row (not only in 'all together'), and
    every right answer written another way gets them all."""
    entry, rows = mutants.MUTANTS[mutant], mutant_rows[mutant]
    assert [r.exercise for r in rows] == [entry.row], f"{mutant}: graded in {[r.exercise for r in rows]}"
    (row,) = rows
    if entry.correct:
        assert row.passed == row.cases, f"{mutant} is right, but fails: {row.first_failure}"
    else:
        assert row.failed, f"{mutant} is wrong, but passes all {row.cases} graders of {entry.row}"


FAILING_JUNIT = """<testsuites><testsuite>
  <testcase classname="tests.test_ch04_exercises" name="test_colmajor_index_matches_fortran_order[0]">
    <failure message="AssertionError: colmajor_index(1, 0, 3) = 3">trace</failure></testcase>
</testsuite></testsuites>"""


def test_grade_report_prints_its_seed_and_reruns_with_it(tmp_path, capsys, monkeypatch):
    """The run's seed goes to pytest and into the report, the printed rerun command draws the same inputs, and a
    score short of full marks ends on a line saying that the exit status means exactly that."""
    handed = []

    def pytest_run(cmd, cwd, env):
        handed.append(env[grade_report.SEED_ENV])
        Path(next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1]).write_text(FAILING_JUNIT)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(grade_report.subprocess, "run", pytest_run)
    junit = ["--junit", str(tmp_path / "grades.xml")]
    for pinned in ("12345", None):
        if pinned:
            monkeypatch.setenv(grade_report.SEED_ENV, pinned)
        else:
            monkeypatch.delenv(grade_report.SEED_ENV)
        assert grade_report.main(["--chapters", "4", *junit]) == 1
        out, seed = capsys.readouterr().out, handed[-1]
        assert seed == pinned if pinned else seed.isdigit(), f"the seed handed to pytest: {seed!r}"
        assert f"random seed {seed}" in out, out
        assert f"TINYVLLM_TEST_SEED={seed} " in out, out
        assert "-m pytest tests/test_ch04_exercises.py --impl=student -x" in out, out
        assert "not all points" in out.rstrip().splitlines()[-1]


def test_an_error_escaping_the_function_under_test_names_the_call():
    """A NumPy error (or an assert of the student's own) escaping an exercise's function says which call raised
    it; a TinyVLLMError, which graders may expect, passes unchanged."""
    def shard(weight, world):
        return np.split(weight, world)

    with pytest.raises(ValueError) as e:
        naming_its_input("shard_weight", shard)(np.zeros((5, 3), np.float32), world=2)
    assert e.value.__notes__ == ["raised inside shard_weight(float32 array (5, 3), world=2)"]

    def refuse():
        raise TinyVLLMError("world 2 does not divide 5 heads")

    with pytest.raises(TinyVLLMError) as e:
        naming_its_input("shard_weight", refuse)()
    assert not getattr(e.value, "__notes__", None)
