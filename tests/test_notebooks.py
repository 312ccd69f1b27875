"""Every notebook runs top to bottom on the CPU (the notebooks are thin: the code lives in .py files),
and shows what it is there to show: every code cell ran, every figure cell drew a picture, every cell
that prints printed something. The notebooks are committed executed, so they show their figures wherever
they are opened: `make notebooks` runs them and writes them back (TINYVLLM_WRITE_NOTEBOOKS=1), and a fast
test checks that the committed files hold their outputs."""
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# a cell whose last line calls a plots.draw_* (or server_demo.draw_*) function: it must show an image
FIGURE_CALL = re.compile(r"^[\w.]*\bdraw_\w+\([^()]*\);?$")


def output_problems(nb) -> list[str]:
    """What an executed notebook failed to show. (nbclient's execute() already raises on an exception in
    a cell; this catches the notebook that runs but shows nothing: a skipped cell, a figure function that
    draws nothing or returns None, output lost to a wrong matplotlib backend, a print that never ran.)"""
    problems, count = [], 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        count += 1
        outputs, last = cell.get("outputs", []), cell.source.strip().splitlines()[-1].strip()
        where = f"cell {i} ({last[:60]!r})"
        if cell.get("execution_count") != count:
            problems.append(f"{where}: execution_count {cell.get('execution_count')}, expected {count}")
        images = any("image/png" in o.get("data", {}) for o in outputs)
        printed = any(o.get("output_type") == "stream" and o.get("name") == "stdout" and o.get("text", "").strip()
                      for o in outputs)
        if FIGURE_CALL.match(last) and not images:
            problems.append(f"{where}: draws a figure but shows no image/png")
        if "print(" in cell.source and not (printed or images):  # `draw() if ... else print()`: one of them
            problems.append(f"{where}: prints but wrote nothing to stdout")
    return problems


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2, "notebooks/ should hold the chapter notebooks"


def test_output_check_catches_a_notebook_that_shows_nothing():
    """output_problems on hand-made executed notebooks: it passes a good one and names each failure."""
    def executed(*cells):
        nb = new_notebook(cells=[new_code_cell(source, execution_count=n, outputs=outs)
                                 for source, n, outs in cells])
        return nb
    png = new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})
    text = new_output("stream", name="stdout", text="42 ids\n")
    good = executed(("import numpy as np", 1, []), ("print(len(ids), 'ids')", 2, [text]),
                    ("plots.draw_forward_pass();", 3, [png]), ("x = 1 if ok else print('no')", 4, [text]))
    assert output_problems(good) == []
    bad = executed(("import numpy as np", 1, []), ("print(len(ids), 'ids')", 2, []),
                   ("plots.draw_forward_pass();", 3, [new_output("display_data", data={"text/plain": "None"})]),
                   ("server_demo.draw_server_batch(run)", None, [png]))
    problems = output_problems(bad)
    assert len(problems) == 3, problems
    assert "cell 1" in problems[0] and "stdout" in problems[0]
    assert "cell 2" in problems[1] and "image/png" in problems[1]
    assert "cell 3" in problems[2] and "execution_count None" in problems[2]


@pytest.mark.notebooks
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, default_model_dir):
    nb = nbformat.read(path, as_version=4)
    # execute() raises CellExecutionError on the first cell that raises: no error output can survive it
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    problems = output_problems(nb)
    assert not problems, "\n".join(problems)
    if os.environ.get("TINYVLLM_WRITE_NOTEBOOKS") == "1":   # make notebooks: commit what a reader will see
        tmp = path.with_suffix(".ipynb.tmp")
        nbformat.write(nb, tmp)
        tmp.replace(path)                                    # whole or not at all


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_shows_its_outputs(path):
    """The file in the repository is the executed notebook (make notebooks), not bare calls."""
    problems = output_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name} is not committed executed; run `make notebooks`:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_shows_no_stderr(path):
    """A reader sees what the cells print, not a progress bar's every redraw or a library's warning: each
    stderr write is an output of its own in the file, and GitHub shows them all."""
    nb = nbformat.read(path, as_version=4)
    stderr = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    assert not stderr, f"{path.name}: stderr outputs in cells {sorted(set(stderr))} (e.g. use_tqdm=True)"
