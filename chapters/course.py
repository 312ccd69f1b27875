"""`make course`: every chapter's checkpoint in order, stopping at the first one that fails.

    python -m chapters.course                  # every chapter, in order, against the engine
    python -m chapters.course --impl student   # the same, with your exercises.py functions plugged in
    python -m chapters.course --full           # each checkpoint's whole run, where its default is smaller

Each checkpoint runs in its own process (`python -m chapters N`), exactly as `make chapter-N` runs it,
so one chapter's plugged-in functions never leak into the next.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from chapters.grading import IMPLS, chapter_numbers, chapter_package

CHAPTERS = chapter_numbers()


def run_checkpoint(chapter: int, impl: str, full: bool = False) -> int:
    """Exit code of `python -m chapters <chapter> --impl <impl> [--full]`; its output goes straight to the terminal."""
    return subprocess.run([sys.executable, "-m", "chapters", str(chapter), "--impl", impl]
                          + (["--full"] if full else [])).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chapters.course")
    parser.add_argument("--impl", choices=IMPLS, default="reference")
    parser.add_argument("--full", action="store_true", help="each checkpoint's whole run (python -m chapters N --full)")
    args = parser.parse_args(argv)
    times, load_at_start = [], os.getloadavg()[0]
    for chapter in CHAPTERS:
        name = chapter_package(chapter).split(".")[1]
        print(f"\n===== chapter {chapter}: {name} =====\n", flush=True)
        start = time.perf_counter()
        code = run_checkpoint(chapter, args.impl, args.full)
        times.append((chapter, name, time.perf_counter() - start))
        if code != 0:
            print(f"\ncourse: STOPPED at chapter {chapter} ({name}): its checkpoint exited with {code}; "
                  f"run `make chapter-{chapter}` to see it alone", file=sys.stderr)
            return 1
    print("\ncourse: every checkpoint PASSED")
    for chapter, name, seconds in times:
        print(f"  chapter {chapter}  {name:<20} {seconds:6.1f} s")
    # the seconds depend on what else the machine ran: the load average says how busy it was
    print(f"  in all {sum(s for _, _, s in times):.0f} s; load average (1 min) {load_at_start:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
