"""`make grade`: run the exercise graders, write JUnit XML, print a score table.

    python -m chapters.grade_report                      # every chapter, your exercises.py
    python -m chapters.grade_report --chapters 1 6       # some chapters
    python -m chapters.grade_report --impl reference     # the engine's functions (full marks expected)

One point per grader test case (each parametrized case counts once). A test's exercise is the one
whose name appears in the test's name (`test_rms_norm_...` grades rms_norm); a test naming several
exercises, or none, grades the chapter's exercises together. A grader skipped because the machine has
no GPU shows as "needs GPU" and earns nothing: it is never counted as passed.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from chapters.grading import IMPLS, exercises

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = tuple(range(1, 8))
TOGETHER = "all together"  # the row of tests that exercise several of a chapter's functions at once


@dataclass
class Row:
    chapter: int
    exercise: str  # "1.1 rms_norm", or TOGETHER
    passed: int = 0
    failed: int = 0
    needs_gpu: int = 0
    skipped: int = 0
    first_failure: str = ""  # the first failing test and its message, to start from

    @property
    def points(self) -> int:
        return self.passed + self.failed + self.needs_gpu + self.skipped

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


def score(junit_xml: Path) -> list[Row]:
    """One row per (chapter, exercise) from a pytest --junitxml file, in chapter and exercise order."""
    rows: dict[tuple[int, str], Row] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        found = re.search(r"test_ch(\d+)_", case.get("classname", ""))
        if not found:
            continue
        chapter, name = int(found.group(1)), case.get("name", "")
        exercise = exercise_of(name, chapter)
        row = rows.setdefault((chapter, exercise), Row(chapter, exercise))
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            row.failed += 1
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            row.first_failure = row.first_failure or f"{name}: {(bad.get('message') or '').splitlines()[0][:150]}"
        elif skipped is not None:
            if "GPU" in (skipped.get("message") or ""):
                row.needs_gpu += 1
            else:
                row.skipped += 1
        else:
            row.passed += 1
    return sorted(rows.values(), key=lambda r: (r.chapter, r.exercise == TOGETHER, r.exercise))


def table(rows: list[Row]) -> str:
    lines = [f"{'chapter':<8} {'exercise':<34} {'result':<10} {'points':>9}", "-" * 64]
    for r in rows:
        lines.append(f"{r.chapter:<8} {r.exercise:<34} {r.result:<10} {r.passed:>4} / {r.points:<3}")
    earned, total = sum(r.passed for r in rows), sum(r.points for r in rows)
    gpu = sum(r.needs_gpu for r in rows)
    lines += ["-" * 64, f"{'total':<54} {earned:>4} / {total:<3}"]
    if gpu:
        lines.append(f"({gpu} of these points are CUDA C graders that need a GPU: run `make grade` on a "
                     "machine with an NVIDIA GPU and CuPy to earn them)")
    failing = [f"  {r.exercise}: {r.first_failure}" for r in rows if r.failed]
    if failing:
        lines += ["", "first failure of each exercise (run `pytest -m chN --impl=student -x` for the traceback):"] + failing
    return "\n".join(line.rstrip() for line in lines)


def run_graders(chapters: list[int], impl: str, junit_xml: Path) -> int:
    """pytest over the chapters' grader files; its own output is kept short (the table says the rest)."""
    files = [str(p.relative_to(ROOT)) for n in chapters for p in ROOT.glob(f"tests/test_ch{n:02d}_exercises.py")]
    marks = " or ".join(f"ch{n}" for n in chapters)
    cmd = [sys.executable, "-m", "pytest", "-q", "--no-header", "-p", "no:cacheprovider", "--tb=no", "-rN",
           f"--impl={impl}", "-m", marks, f"--junitxml={junit_xml}", *files]
    return subprocess.run(cmd, cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chapters.grade_report")
    parser.add_argument("--chapters", type=int, nargs="+", default=list(CHAPTERS), choices=CHAPTERS)
    parser.add_argument("--impl", choices=IMPLS, default="student")
    parser.add_argument("--junit", type=Path, default=ROOT / "grades.xml", help="where to write the JUnit XML")
    args = parser.parse_args(argv)
    code = run_graders(args.chapters, args.impl, args.junit)
    if not args.junit.exists():
        print(f"error: pytest wrote no {args.junit} (exit code {code})", file=sys.stderr)
        return 2
    rows = score(args.junit)
    print(f"\ngrades ({args.impl} implementation), JUnit XML in {args.junit}:\n")
    print(table(rows))
    return 0 if rows and all(r.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
