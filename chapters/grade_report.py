"""`make grade`: run the exercise graders, write JUnit XML, print a score table.

    python -m chapters.grade_report                      # every chapter, your exercises.py
    python -m chapters.grade_report --chapters 1 6       # some chapters
    python -m chapters.grade_report --impl reference     # the engine's functions (full marks expected)
    TINYVLLM_TEST_SEED=1234 python -m chapters.grade_report   # the random inputs of an earlier run again

Points follow ideas, not test counts: each exercise has a weight (POINTS below) and earns
weight x (its grader cases passed / its grader cases), so an exercise checked on 31 parametrized cases
weighs no more than one checked on 3. A test's exercise is the one whose name appears in the test's name
(`test_rms_norm_...` grades rms_norm); a test naming several exercises, or none, grades the chapter's
exercises together (the TOGETHER row). A grader skipped because the machine has no GPU shows as
"needs GPU" and earns nothing: it is never counted as passed.

The graders draw random inputs from one seed per run (tests/seeding.py): the report prints it, and the
command it gives for a failing chapter reruns with it, so the rerun draws the same inputs.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from chapters.grading import IMPLS, chapter_numbers, exercises

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = tuple(chapter_numbers())
TOGETHER = "all together"  # the row of tests that exercise several of a chapter's functions at once
SEED_ENV = "TINYVLLM_TEST_SEED"  # tests/seeding.py's base seed: every grader's inputs follow from it

# What each exercise is worth: the size of the idea, not the number of its grader cases. The CUDA C
# exercises (3.2, 5.2, 8.5) are graded on a GPU only. INSTRUCTORS.md lists the same table; tests/test_course.py
# checks that the two agree and that every exercise has a weight.
POINTS = {
    1: {"rms_norm": 2, "rope_inv_freq": 3, "apply_rope": 2, "softmax": 2, "attention": 4, TOGETHER: 2},
    2: {"parse_header": 6, "bf16_bits_to_float32": 1, "float32_to_bf16_bits": 3, "lay_out": 2},
    3: {"online_softmax_attention": 6, "RMS_NORM_KERNEL_SOURCE": 6},
    4: {"gemm_params": 4, "gemm_params_into_slice": 3, "colmajor_index": 1},
    5: {"decode_attention": 6, "DECODE_ATTENTION_KERNEL_SOURCE": 8},
    6: {"BlockManager": 8, "slot_mapping": 3},
    7: {"admit": 8, "choose_victim": 2, TOGETHER: 2},
    8: {"step_bytes": 3, "floor_ms": 1, "rms_norm_gemv_block": 4, "rms_norm_gemv_swiglu_block": 3,
        "GEMV_ADD_KERNEL_SOURCE": 4, TOGETHER: 2},
    9: {"shard_weight": 5, "parallel_mlp": 4, TOGETHER: 2},
    10: {"propose_ngram": 3, "accept_greedy": 2, "rejection_sample": 4, "rollback_block_table": 2, TOGETHER: 2},
    11: {"compile_dfa": 5, "token_states": 4, "schema_tree": 4, TOGETHER: 2},
}


@dataclass
class Row:
    chapter: int
    exercise: str  # "1.1 rms_norm", or TOGETHER
    weight: int = 0  # the exercise's points (POINTS)
    passed: int = 0  # grader cases, each parametrized case once
    failed: int = 0
    needs_gpu: int = 0
    skipped: int = 0
    first_failure: str = ""  # the first failing test and its message, to start from

    @property
    def cases(self) -> int:
        return self.passed + self.failed + self.needs_gpu + self.skipped

    @property
    def earned(self) -> float:
        """weight x the fraction of cases passed: a skipped or GPU-only case earns nothing."""
        return self.weight * self.passed / self.cases if self.cases else 0.0

    @property
    def result(self) -> str:
        if self.failed:
            return f"failed {self.failed}"
        if self.needs_gpu:
            return "needs GPU"
        if self.skipped:
            return "skipped"
        return "passed"


def exercise_names(chapter: int) -> list[str]:
    """The chapter's exercises in their numbered order: REFERENCE's entries, then the CUDA C ones."""
    ex = exercises(chapter)
    return list(ex.REFERENCE) + list(getattr(ex, "GPU_EXERCISES", {}))


def exercise_of(test_name: str, chapter: int) -> str:
    """'1.1 rms_norm' for test_rms_norm_matches...[1.0] of chapter 1; TOGETHER if it names 0 or 2+ exercises."""
    base = test_name.split("[")[0].lower()
    names = exercise_names(chapter)
    hits = [n for n in names if n.lower() in base]
    hits = [n for n in hits if not any(n != m and n.lower() in m.lower() for m in hits)]  # rms_norm inside rms_norm_kernel_source
    if len(hits) != 1:
        return TOGETHER
    return f"{chapter}.{names.index(hits[0]) + 1} {hits[0]}"


def weight(chapter: int, exercise: str) -> int:
    """POINTS of a row: '1.1 rms_norm' -> POINTS[1]['rms_norm']."""
    name = exercise if exercise == TOGETHER else exercise.split(" ", 1)[1]
    try:
        return POINTS[chapter][name]
    except KeyError:
        raise LookupError(f"chapter {chapter}'s {exercise!r} has no weight: add it to POINTS in "
                          "chapters/grade_report.py (and to the table in INSTRUCTORS.md)") from None


TEMP_PATH = re.compile(re.escape(tempfile.gettempdir()) + r"/[^\s'\"]*/([^/\s'\"]+)")
# after the grader's own message: pytest's explanation of the assert, hypothesis' notes on the example
EXPLANATION = re.compile(r"^(assert |\+ +where |Failing test case|Falsifying example|You can reproduce|Explanation:)")


def failure_text(message: str, limit: int = 240) -> str:
    """The first informative line(s) of a failure's message, on one line.

    pytest's message is "AssertionError: <the grader's message>", then its explanation of the assert
    (or, for a bare assert, that explanation alone); hypothesis adds the example it shrank to. Kept: the
    first paragraph, at most two lines, up to the explanation. A temp file's path (new on every run) is
    cut down to the file's name.
    """
    lines: list[str] = []
    for line in message.splitlines():
        line = TEMP_PATH.sub(r"\1", line.strip()).removeprefix("AssertionError: ").removeprefix("Failed: ")
        if lines and (not line or EXPLANATION.match(line)):
            break
        if line and line != "AssertionError:":
            lines.append(line)
        if len(lines) == 2:
            break
    text = " | ".join(lines) or "(no message)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def score(junit_xml: Path) -> list[Row]:
    """One row per (chapter, exercise) from a pytest --junitxml file, in chapter and exercise order."""
    rows: dict[tuple[int, str], Row] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        found = re.search(r"test_ch(\d+)_", case.get("classname", ""))
        if not found:
            continue
        chapter, name = int(found.group(1)), case.get("name", "")
        exercise = exercise_of(name, chapter)
        row = rows.setdefault((chapter, exercise), Row(chapter, exercise, weight(chapter, exercise)))
        skipped = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            row.failed += 1
            row.first_failure = row.first_failure or f"{name}: {failure_text(bad.get('message') or '')}"
        elif skipped is not None:
            if "GPU" in (skipped.get("message") or ""):
                row.needs_gpu += 1
            else:
                row.skipped += 1
        else:
            row.passed += 1
    return sorted(rows.values(), key=lambda r: (r.chapter, r.exercise == TOGETHER, r.exercise))


def grader_command(chapter: int, impl: str = "student", seed: str | None = None) -> str:
    """The command that runs one chapter's graders alone and stops at the first failure, with its traceback;
    with the run's seed, on the same inputs."""
    python = Path(sys.executable)
    shown = os.path.relpath(python, ROOT) if python.is_relative_to(ROOT) else str(python)  # .venv/bin/python
    pinned = f"{SEED_ENV}={seed} " if seed is not None else ""
    return f"{pinned}{shown} -m pytest tests/test_ch{chapter:02d}_exercises.py --impl={impl} -x"


def table(rows: list[Row], impl: str = "student", seed: str | None = None) -> str:
    lines = [f"{'chapter':<8} {'exercise':<34} {'result':<10} {'cases':>7}  {'points':>10}", "-" * 74]
    for r in rows:
        lines.append(f"{r.chapter:<8} {r.exercise:<34} {r.result:<10} {r.passed:>3}/{r.cases:<3}  "
                     f"{r.earned:>5.1f} / {r.weight:<2}")
    earned, total = sum(r.earned for r in rows), sum(r.weight for r in rows)
    gpu = sum(r.weight for r in rows if r.needs_gpu)
    lines += ["-" * 74, f"{'total':<63} {earned:>5.1f} / {total:<3}"]
    if gpu:
        lines.append(f"({gpu} of these points are CUDA C graders that need a GPU: run `make grade` on a "
                     "machine with an NVIDIA GPU and CuPy to earn them)")
    failing = [r for r in rows if r.failed]
    if failing:
        lines += ["", "first failure of each exercise; for its traceback, run that chapter's graders alone:"]
        for chapter in sorted({r.chapter for r in failing}):
            lines.append(f"  {grader_command(chapter, impl, seed)}")
            lines += [f"    {r.exercise}: {r.first_failure}" for r in failing if r.chapter == chapter]
        # make adds "make: *** [grade] Error 1" after this line: it must not read as a broken build
        lines += ["", "not all points: the exit status is 1 (make reports it as \"Error 1\"); nothing is broken"]
    return "\n".join(line.rstrip() for line in lines)


def run_seed() -> str:
    """The base seed of this run: $TINYVLLM_TEST_SEED if set (to repeat a run), else a fresh one."""
    return os.environ.get(SEED_ENV, "").strip() or str(secrets.randbits(32))


def run_graders(chapters: list[int], impl: str, junit_xml: Path, seed: str) -> int:
    """pytest over the chapters' grader files, drawing their inputs from `seed`; its own output is kept short
    (the table says the rest)."""
    files = [str(p.relative_to(ROOT)) for n in chapters for p in ROOT.glob(f"tests/test_ch{n:02d}_exercises.py")]
    marks = " or ".join(f"ch{n}" for n in chapters)
    cmd = [sys.executable, "-m", "pytest", "-q", "--no-header", "-p", "no:cacheprovider", "--tb=no", "-rN",
           f"--impl={impl}", "-m", marks, f"--junitxml={junit_xml}", *files]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, SEED_ENV: seed}).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chapters.grade_report")
    parser.add_argument("--chapters", type=int, nargs="+", default=list(CHAPTERS), choices=CHAPTERS)
    parser.add_argument("--impl", choices=IMPLS, default="student")
    parser.add_argument("--junit", type=Path, default=ROOT / "grades.xml", help="where to write the JUnit XML")
    args = parser.parse_args(argv)
    seed = run_seed()
    code = run_graders(args.chapters, args.impl, args.junit, seed)
    if not args.junit.exists():
        print(f"error: pytest wrote no {args.junit} (exit code {code})", file=sys.stderr)
        return 2
    rows = score(args.junit)
    print(f"\ngrades ({args.impl} implementation), random seed {seed} ({SEED_ENV}={seed} repeats this run), "
          f"JUnit XML in {args.junit}:\n")
    print(table(rows, args.impl, seed))
    return 0 if rows and all(r.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
