"""The engine's layers import one way: entrypoints -> engine -> model -> formats (README.md, "Layout").

Read from the source with ast, so a lazy import inside a function counts as much as one at the top.
tinyvllm/errors.py is shared by every layer; tinyvllm/reference.py (the oracle) imports formats/ only,
and nothing in the engine imports it: on the CPU, "engine against reference" must compare two codes.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tinyvllm"
LAYERS = ["formats", "model", "engine", "entrypoints"]   # each may import the ones before it, and itself
SHARED = {"tinyvllm.errors"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every tinyvllm module the file imports: `from tinyvllm.x import y` names tinyvllm.x.y when y is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tinyvllm")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tinyvllm"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (PACKAGE.parent / Path(*sub.split("."))).is_dir()
                found.add(sub if is_module else node.module)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def allowed(importer: str, imported: str) -> bool:
    if imported in SHARED:
        return True
    if imported == "tinyvllm.reference":
        return False                                   # the oracle is for tests and the course only
    if importer == "tinyvllm.reference":
        return layer_of(imported) == "formats"
    mine, theirs = layer_of(importer), layer_of(imported)
    if mine is None:                                   # tinyvllm/__init__.py, __main__.py: the package's face
        return True
    return theirs is not None and LAYERS.index(theirs) <= LAYERS.index(mine)


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_layer():
    loose = [module_name(p) for p in SOURCES if layer_of(module_name(p)) is None
             and module_name(p) not in {"tinyvllm", "tinyvllm.__main__", "tinyvllm.errors", "tinyvllm.reference"}]
    assert not loose, f"modules outside the four layers: {loose}; move each into formats/, model/, engine/ or entrypoints/"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path):
    importer = module_name(path)
    wrong = sorted(m for m in imported_modules(path) if m != importer and not allowed(importer, m))
    assert not wrong, (f"{importer} ({layer_of(importer) or 'top level'}) imports {wrong}: imports run "
                       f"entrypoints -> engine -> model -> formats, and only tests and the course import reference")


def test_the_checker_catches_a_wrong_way_import():
    """The rule itself can fail: a model module importing the engine or the oracle is refused."""
    assert not allowed("tinyvllm.model.prefill", "tinyvllm.engine.block_manager")
    assert not allowed("tinyvllm.model.backend.numpy_ops", "tinyvllm.reference")
    assert not allowed("tinyvllm.formats.config", "tinyvllm.model.kv_pool")
    assert not allowed("tinyvllm.reference", "tinyvllm.model.model")
    assert allowed("tinyvllm.engine.scheduler", "tinyvllm.model.step_plan")
    fake = PACKAGE / "model" / "kv_pool.py"
    assert "tinyvllm.model.step_plan" in imported_modules(fake)


THE_DOOR = {"tinyvllm.model.runner", "tinyvllm.model.step_plan"}   # what the engine may import of model/


@pytest.mark.parametrize("path", sorted((PACKAGE / "engine").glob("*.py")), ids=lambda p: p.name)
def test_the_engine_reaches_the_model_through_one_door(path):
    """The engine hands the model runner a plan and reads back a StepOutput: it imports the runner and the plan,
    nothing else of model/ (no kernels, no pools, no forward pass of its own choosing)."""
    beyond = sorted(m for m in imported_modules(path) if layer_of(m) == "model" and m not in THE_DOOR)
    assert not beyond, f"{module_name(path)} imports {beyond} from model/; go through {sorted(THE_DOOR)}"
