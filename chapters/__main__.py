"""`python -m chapters N [--impl student]`: run chapter N's checkpoint (what `make chapter-N` calls)."""
import argparse
import importlib
import sys

from chapters.grading import IMPLS, chapter_package, plug_in_student
from tinyvllm.errors import TinyVLLMError

parser = argparse.ArgumentParser(prog="python -m chapters")
parser.add_argument("chapter", type=int)
parser.add_argument("--impl", choices=IMPLS, default="reference",
                    help="student: run the engine with your exercises.py functions plugged in")
args = parser.parse_args()
try:
    package = chapter_package(args.chapter)
    if args.impl == "student":
        print(f"using your functions for: {', '.join(plug_in_student(args.chapter))}\n")
    ok = importlib.import_module(package + ".checkpoint").main()
except (LookupError, TinyVLLMError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
except NotImplementedError as e:
    exercises = package.replace(".", "/") + "/exercises.py"
    print(f"error: {e} — fill it in, in {exercises}, then run again", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if ok else 1)
