"""`make figures`: draw every chapter's figures from the real files into figures/*.png.

Each chapter's `plots.py` lists FIGURES = {"file.png": function() -> matplotlib Figure}; the notebooks
call the same functions, so a figure in a chapter's README is exactly what its notebook shows.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import matplotlib

import chapters

FIGURES_DIR = Path(__file__).resolve().parent.parent / "figures"


def all_figures() -> dict:
    """{file name: plotting function} over every chapter that has a plots.py."""
    found = {}
    for info in sorted(pkgutil.iter_modules(chapters.__path__), key=lambda i: i.name):
        if info.ispkg and info.name.startswith("ch"):
            try:
                plots = importlib.import_module(f"chapters.{info.name}.plots")
            except ModuleNotFoundError as e:
                if e.name != f"chapters.{info.name}.plots":
                    raise
                continue
            found.update(plots.FIGURES)
    return found


def main() -> None:
    matplotlib.use("Agg")
    FIGURES_DIR.mkdir(exist_ok=True)
    for name, draw in all_figures().items():
        fig = draw()
        fig.savefig(FIGURES_DIR / name, dpi=120, bbox_inches="tight")
        matplotlib.pyplot.close(fig)
        print(f"wrote figures/{name}")


if __name__ == "__main__":
    main()
