"""One test suite grades both the engine and the student (the tiny-llm / CS336 pattern).

Each chapter's `exercises.py` declares REFERENCE = {exercise name: "module:function"} — the engine
function the exercise re-implements, with the same signature. A grader asks for an implementation by
name and gets the engine's (impl="reference") or the student's (impl="student").
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Callable

import chapters

IMPLS = ("reference", "student")


def chapter_package(chapter: int) -> str:
    """chapters.chNN_<slug> for chapter N."""
    prefix = f"ch{chapter:02d}_"
    for info in pkgutil.iter_modules(chapters.__path__):
        if info.name.startswith(prefix):
            return f"chapters.{info.name}"
    raise LookupError(f"there is no chapter {chapter} (no chapters/{prefix}* package)")


def chapter_numbers() -> list[int]:
    """The chapters that exist, in order: one per chapters/chNN_* package. Not 1 .. n: a chapter may be
    missing."""
    return sorted(int(info.name[2:4]) for info in pkgutil.iter_modules(chapters.__path__)
                  if info.ispkg and info.name[:2] == "ch" and info.name[2:4].isdigit())


def exercises(chapter: int) -> ModuleType:
    return importlib.import_module(chapter_package(chapter) + ".exercises")


def _resolve(path: str) -> tuple[ModuleType, str]:
    module, _, name = path.partition(":")
    return importlib.import_module(module), name


def implementation(chapter: int, name: str, impl: str) -> Callable:
    """The function under test for exercise `name` of `chapter`."""
    ex = exercises(chapter)
    if impl == "student":
        return getattr(ex, name)
    module, attr = _resolve(ex.REFERENCE[name])
    return getattr(module, attr)


def plug_in_student(chapter: int) -> list[str]:
    """Replace the engine functions with the student's, so the whole engine runs on their code."""
    ex, replaced = exercises(chapter), []
    for name, path in ex.REFERENCE.items():
        module, attr = _resolve(path)
        setattr(module, attr, getattr(ex, name))
        replaced.append(path)
    return replaced
