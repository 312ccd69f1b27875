"""`python -m chapters N [--impl student] [--full]`: run chapter N's checkpoint (what `make chapter-N` calls)."""
import os

# NumPy's BLAS (and torch) get one thread, set before they load; a variable you set yourself wins. A BLAS thread
# that waits for its partner keeps spinning, so on 2 cores that other programs share, two threads fight for
# them: chapter 5's checkpoint took 78 and 207 s with two threads, 15 and 18 s with one (load average 5 to 7).
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
    os.environ.setdefault(variable, "1")

import argparse  # noqa: E402  (after the thread counts: these imports load NumPy)
import importlib  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402

from chapters.grading import IMPLS, chapter_package, plug_in_student  # noqa: E402
from tinyvllm.errors import TinyVLLMError  # noqa: E402

parser = argparse.ArgumentParser(prog="python -m chapters")
parser.add_argument("chapter", type=int)
parser.add_argument("--impl", choices=IMPLS, default="reference",
                    help="student: run the engine with your exercises.py functions plugged in")
parser.add_argument("--full", action="store_true",
                    help="the chapter text's whole run, where the default is a smaller one that fits a "
                         "shared 2-core machine (chapter 7); other checkpoints always run in full")
args = parser.parse_args()
try:
    package = chapter_package(args.chapter)
    if args.impl == "student":
        print(f"using your functions for: {', '.join(plug_in_student(args.chapter))}\n")
    main = importlib.import_module(package + ".checkpoint").main
    ok = main(full=True) if args.full and "full" in inspect.signature(main).parameters else main()
except (LookupError, TinyVLLMError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
except NotImplementedError as e:
    exercises = package.replace(".", "/") + "/exercises.py"
    print(f"error: {e} — fill it in, in {exercises}, then run again", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if ok else 1)
