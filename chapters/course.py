"""`make course`: every chapter's checkpoint in order, stopping at the first one that fails.

    python -m chapters.course                  # every chapter (1 .. 9) against the engine
    python -m chapters.course --impl student   # the same, with your exercises.py functions plugged in

Each checkpoint runs in its own process (`python -m chapters N`), exactly as `make chapter-N` runs it,
so one chapter's plugged-in functions never leak into the next.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

from chapters.grading import IMPLS, chapter_numbers, chapter_package

CHAPTERS = chapter_numbers()


def run_checkpoint(chapter: int, impl: str) -> int:
    """Exit code of `python -m chapters <chapter> --impl <impl>`; its output goes straight to the terminal."""
    return subprocess.run([sys.executable, "-m", "chapters", str(chapter), "--impl", impl]).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chapters.course")
    parser.add_argument("--impl", choices=IMPLS, default="reference")
    args = parser.parse_args(argv)
    times = []
    for chapter in CHAPTERS:
        name = chapter_package(chapter).split(".")[1]
        print(f"\n===== chapter {chapter}: {name} =====\n", flush=True)
        start = time.perf_counter()
        code = run_checkpoint(chapter, args.impl)
        times.append((chapter, name, time.perf_counter() - start))
        if code != 0:
            print(f"\ncourse: STOPPED at chapter {chapter} ({name}): its checkpoint exited with {code}; "
                  f"run `make chapter-{chapter}` to see it alone", file=sys.stderr)
            return 1
    print("\ncourse: every checkpoint PASSED")
    for chapter, name, seconds in times:
        print(f"  chapter {chapter}  {name:<14} {seconds:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
