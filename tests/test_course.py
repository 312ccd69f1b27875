"""The course holds together: every chapter has its parts, every figure is drawn and shown, every link
resolves, `make course` stops at the first failing checkpoint, and `make grade` scores what it ran.

(That every notebook runs top to bottom on the CPU is tests/test_notebooks.py.)
"""
from __future__ import annotations

import importlib
import inspect
import re
import tempfile
from pathlib import Path

import pytest

from chapters import course, grade_report
from chapters.figures import all_figures
from chapters.grading import chapter_numbers, chapter_package, exercises

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = chapter_numbers()  # every chapters/chNN_* package, in order


def slug(chapter: int) -> str:
    """'ch01_map' -> 'map'."""
    return chapter_package(chapter).split(".")[1].split("_", 1)[1]


# ---------- every chapter has its text, checkpoint, exercises, graders and notebook ----------

@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_has_every_part(chapter):
    folder = ROOT / "chapters" / chapter_package(chapter).split(".")[1]
    assert (folder / "README.md").is_file(), f"{folder.name} has no README.md"
    checkpoint = importlib.import_module(chapter_package(chapter) + ".checkpoint")
    assert callable(getattr(checkpoint, "main", None)), f"{folder.name}/checkpoint.py has no main()"
    assert exercises(chapter).REFERENCE, f"{folder.name}/exercises.py declares no exercise"
    assert (ROOT / "tests" / f"test_ch{chapter:02d}_exercises.py").is_file(), "no grader file"
    notebook = ROOT / "notebooks" / f"{chapter:02d}_{slug(chapter)}.ipynb"
    assert notebook.is_file(), f"chapter {chapter} has no notebook {notebook.relative_to(ROOT)}"


def test_no_notebook_without_a_chapter():
    expected = {f"{n:02d}_{slug(n)}.ipynb" for n in CHAPTERS}
    assert {p.name for p in (ROOT / "notebooks").glob("*.ipynb")} == expected


def grader_names(chapter: int) -> list[str]:
    text = (ROOT / "tests" / f"test_ch{chapter:02d}_exercises.py").read_text()
    return re.findall(r"^def (test_\w+)\(", text, re.M)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_has_its_reference_its_stub_and_a_grader_named_after_it(chapter):
    ex = exercises(chapter)
    graders = grader_names(chapter)
    for number, name in enumerate(grade_report.exercise_names(chapter), start=1):
        label = f"Exercise {chapter}.{number}"
        if name in ex.REFERENCE:
            module, _, attr = ex.REFERENCE[name].partition(":")
            assert hasattr(importlib.import_module(module), attr), f"{name}: REFERENCE points nowhere"
            assert f'"{label}: {name}' in inspect.getsource(ex), f"{name}'s stub does not raise '{label}: {name}'"
        else:  # CUDA C: the engine's kernel file, and a stub string that says which exercise it is
            assert (ROOT / ex.GPU_EXERCISES[name]).is_file(), f"{name}: no {ex.GPU_EXERCISES[name]}"
            assert label in getattr(ex, name), f"{name}'s stub does not say '{label}'"
        assert any(grade_report.exercise_of(g, chapter).endswith(f" {name}") for g in graders), \
            f"no grader of chapter {chapter} is named after {name} (the score table could not credit it)"


def solved_student_block_manager() -> type:
    """The chapter 6 stub class with its exercise methods solved (by the engine's), the given ones kept."""
    from tinyvllm.engine import block_manager
    given = {"blocks_to_append", "blocks_to_extend", "lookup", "blocks_to_admit", "admit", "truncate", "_release"}
    engine = vars(block_manager.BlockManager)
    solved = {n: f for n, f in engine.items() if n not in given and (n == "__init__" or not n.startswith("__"))}
    return type("Solved", (exercises(6).BlockManager,), solved)


def test_chapter_6_student_block_manager_has_what_chapter_7_calls():
    from tinyvllm.engine import block_manager
    public = {n for n in vars(block_manager.BlockManager) if not n.startswith("_")}
    student = set(vars(exercises(6).BlockManager))
    assert public <= student, f"missing from the stub class: {public - student}"
    bm = solved_student_block_manager()(4)
    bm.allocate(0, 16)
    assert bm.blocks_to_append(0) == 1 and bm.extend(0, 1).tolist() == [16]
    assert bm.blocks_to_append(0) == 0
    hit = bm.lookup(list(range(33)))          # a sequence's length is all lookup reads without prefix caching
    assert (hit.tokens, bm.blocks_to_admit(hit, 33), bm.admit(1, hit)) == (0, 3, 0)


def test_chapter_7_engine_runs_on_the_chapter_6_student_class(tiny_model_dir, monkeypatch, rng):
    """With 6.1 solved, the student class runs chapter 7's scheduler, preemptions included, token for token."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.engine import block_manager
    path = tiny_model_dir
    prompts = [rng.integers(0, 1000, int(rng.integers(17, 40))).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=30)
    alone = [LLM(str(path), device="cpu", num_blocks=64).generate([p], params)[0].token_ids for p in prompts]
    monkeypatch.setattr(block_manager, "BlockManager", solved_student_block_manager())
    # each needs up to 5 blocks: preemption; without prefix caching, the plain block manager (the student's) runs
    llm = LLM(str(path), device="cpu", num_blocks=10, max_num_seqs=4, enable_prefix_caching=False)
    assert type(llm.engine.scheduler.block_manager).__name__ == "Solved"
    seqs = [llm.add_request(p, params) for p in prompts]
    for _ in range(1000):
        if not llm.engine.has_work():
            break
        llm.engine.step()
    assert sum(s.preemptions for s in seqs) > 0, "the pool was meant to run out"
    assert [s.output_ids for s in seqs] == alone


def test_chapter_6_graders_still_fail_on_the_given_methods_alone():
    with pytest.raises(NotImplementedError, match="Exercise 6.1"):
        exercises(6).BlockManager(4)


# ---------- the number of chapters lives in one place: the chapters/ packages ----------

def table_chapters(markdown: str) -> list[int]:
    """The chapter numbers of the Markdown table rows that start `| N |`."""
    return [int(n) for n in re.findall(r"^\| (\d+) \|", markdown, re.M)]


def test_the_readme_table_and_chapter_1s_map_list_every_chapter():
    assert table_chapters((ROOT / "README.md").read_text()) == CHAPTERS, \
        "README.md's course table: one row per chapters/chNN_* package, in order"
    text = (ROOT / "chapters" / "ch01_map" / "README.md").read_text()
    section = text.split("## The code, and the map of the course", 1)[1].split("\n## ", 1)[0]
    assert table_chapters(section) == CHAPTERS, "chapter 1's map: one row per chapters/chNN_* package, in order"


# ---------- figures: drawn by `make figures`, shown by a chapter ----------

def test_every_figure_is_drawn_by_make_figures_and_shown_by_a_chapter():
    drawn = set(all_figures())
    on_disk = {p.name for p in (ROOT / "figures").glob("*.png")}
    assert on_disk <= drawn, f"figures no plots.py draws (make figures would not remake them): {on_disk - drawn}"
    assert drawn <= on_disk, f"figures make figures draws that are not committed: {drawn - on_disk}"
    texts = "".join(p.read_text() for p in (ROOT / "chapters").glob("ch*/README.md"))
    unshown = sorted(name for name in drawn if f"figures/{name})" not in texts)
    assert not unshown, f"figures no chapter README shows: {unshown}"


# ---------- links in the Markdown files resolve ----------

MARKDOWN = sorted([ROOT / "README.md", ROOT / "INSTRUCTORS.md", ROOT / "BENCHMARKS.md", ROOT / "bench" / "README.md",
                   *(ROOT / "chapters").glob("ch*/README.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_anchor_follows_github():
    assert anchor("5. RoPE: one table, shared with decode") == "5-rope-one-table-shared-with-decode"
    assert anchor("Chapter 1 — the map") == "chapter-1--the-map"


@pytest.mark.parametrize("markdown", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_relative_links_resolve(markdown):
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: — not checked offline
            continue
        path, _, fragment = target.partition("#")
        file = (markdown.parent / path).resolve() if path else markdown
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target} (no heading #{fragment})")
    assert not broken, f"{markdown.relative_to(ROOT)}: {broken}"


# a count of chapters written in prose goes stale with the next chapter ("the next two chapters" does not)
CHAPTER_COUNT = re.compile(r"(?<!next )(?<!last )(?<!first )\b(?:one|two|three|four|five|six|seven|eight|nine|ten|"
                           r"eleven|twelve|\d+) chapters\b", re.I)


@pytest.mark.parametrize("markdown", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_no_text_counts_the_chapters(markdown):
    found = CHAPTER_COUNT.findall(markdown.read_text())
    assert not found, f"{markdown.relative_to(ROOT)} counts the chapters ({found}): name them, or let a table list them"


# ---------- make course: stops at the first failing checkpoint ----------

def test_course_stops_at_the_first_failure_and_names_it(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(course, "run_checkpoint", lambda n, impl, full: ran.append(n) or (1 if n == 3 else 0))
    assert course.main([]) == 1
    assert ran == [1, 2, 3]
    assert "chapter 3 (ch03_prefill)" in capsys.readouterr().err


def test_course_runs_every_chapter_in_order_when_all_pass(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(course, "run_checkpoint", lambda n, impl, full: ran.append((n, impl, full)) or 0)
    assert course.main(["--impl", "student"]) == 0
    assert ran == [(n, "student", False) for n in CHAPTERS]
    ran.clear()
    assert course.main(["--full"]) == 0
    assert ran == [(n, "reference", True) for n in CHAPTERS]
    assert "every checkpoint PASSED" in capsys.readouterr().out


# ---------- make grade: the score table ----------

FAKE_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="8">
  <testcase classname="tests.test_ch01_exercises" name="test_rms_norm_matches_llama_rmsnorm[1.0]"/>
  <testcase classname="tests.test_ch01_exercises" name="test_rms_norm_matches_llama_rmsnorm[300.0]">
    <failure message="AssertionError: relative error 0.3">trace</failure></testcase>
  <testcase classname="tests.test_ch01_exercises" name="test_softmax_matches_torch[1.0]"/>
  <testcase classname="tests.test_ch01_exercises" name="test_reference_model_with_your_functions_matches_transformers">
    <error message="NotImplementedError: Exercise 1.1: rms_norm">trace</error></testcase>
  <testcase classname="tests.test_ch03_exercises" name="test_rms_norm_kernel_source_matches_the_numpy_twin[False-1-64-3.0]">
    <skipped type="pytest.skip" message="Exercise 3.2 is graded on a GPU (needs CuPy and an NVIDIA GPU)">x</skipped>
  </testcase>
  <testcase classname="tests.test_ch03_exercises" name="test_online_softmax_attention_matches_torch_sdpa[4-a]"/>
  <testcase classname="tests.test_ch07_exercises" name="test_admit_and_choose_victim_in_the_engine_change_no_answer[0]"/>
  <testcase classname="tests.test_ch07_exercises" name="test_choose_victim_is_the_youngest">
    <skipped type="pytest.skip" message="could not import 'torch'">x</skipped></testcase>
</testsuite></testsuites>
"""


def test_score_of_a_fake_junit_file(tmp_path):
    path = tmp_path / "fake.xml"
    path.write_text(FAKE_JUNIT)
    rows = {(r.chapter, r.exercise): (r.result, r.passed, r.cases, r.earned, r.weight)
            for r in grade_report.score(path)}
    assert rows == {
        (1, "1.1 rms_norm"): ("failed 1", 1, 2, 1.0, 2),  # half its cases: half its 2 points
        (1, "1.4 softmax"): ("passed", 1, 1, 2.0, 2),
        (1, grade_report.TOGETHER): ("failed 1", 0, 1, 0.0, 2),
        (3, "3.1 online_softmax_attention"): ("passed", 1, 1, 6.0, 6),
        (3, "3.2 RMS_NORM_KERNEL_SOURCE"): ("needs GPU", 0, 1, 0.0, 6),  # never counted as passed
        (7, grade_report.TOGETHER): ("passed", 1, 1, 2.0, 2),
        (7, "7.2 choose_victim"): ("skipped", 0, 1, 0.0, 2),
    }
    table = grade_report.table(grade_report.score(path))
    assert re.search(r"total\s+11.0 / 22", table)
    assert "6 of these points are CUDA C graders that need a GPU" in table
    assert "test_rms_norm_matches_llama_rmsnorm[300.0]: relative error 0.3" in table
    assert "tests/test_ch01_exercises.py --impl=student -x" in table  # the chapter's own grader file
    assert "pytest -m" not in table  # (a bare `pytest -m chN` collects the whole suite)


def test_points_follow_the_weight_not_the_number_of_cases():
    """31 cases of one exercise weigh what its POINTS say: weight x the fraction of cases passed."""
    many = grade_report.Row(4, "4.1 gemm_params", weight=4, passed=30, failed=1)
    few = grade_report.Row(4, "4.3 colmajor_index", weight=1, passed=7)
    assert many.cases == 31 and many.earned == pytest.approx(4 * 30 / 31)
    assert few.earned == 1.0
    assert grade_report.Row(3, "3.2 RMS_NORM_KERNEL_SOURCE", weight=6, needs_gpu=10).earned == 0.0


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_has_a_weight(chapter):
    names = set(grade_report.exercise_names(chapter))
    weights = grade_report.POINTS[chapter]
    assert names <= set(weights), f"chapter {chapter}: no weight in POINTS for {names - set(weights)}"
    assert set(weights) <= names | {grade_report.TOGETHER}, f"POINTS names unknown exercises: {set(weights) - names}"
    assert all(isinstance(w, int) and w > 0 for w in weights.values())


def test_instructors_table_lists_the_weights_of_grade_report():
    """INSTRUCTORS.md's exercise table says what grade_report.POINTS counts, and the totals add up."""
    text = (ROOT / "INSTRUCTORS.md").read_text()
    for chapter, weights in grade_report.POINTS.items():
        names = grade_report.exercise_names(chapter)
        for name in names:
            row = re.search(rf"^\| {chapter} \|.*`{name}`.*\| (\d+) \|$", text, re.M)
            assert row, f"INSTRUCTORS.md has no row for {chapter}.{names.index(name) + 1} `{name}` ending in its points"
            assert int(row.group(1)) == weights[name], \
                f"{name}: INSTRUCTORS.md says {row.group(1)}, POINTS {weights[name]}"
        if grade_report.TOGETHER in weights:
            row = re.search(rf"^\| {chapter} \| {chapter}\.x .*\| (\d+) \|$", text, re.M)
            assert row and int(row.group(1)) == weights[grade_report.TOGETHER], \
                f"chapter {chapter}'s 'all together' row: missing, or not {weights[grade_report.TOGETHER]} points"
    total = sum(sum(w.values()) for w in grade_report.POINTS.values())
    gpu = sum(grade_report.POINTS[n][name] for n in CHAPTERS for name in getattr(exercises(n), "GPU_EXERCISES", {}))
    assert f"{total} points in all, {total - gpu} of them on a CPU" in text


def test_failure_text_is_the_first_informative_line():
    text = grade_report.failure_text
    assert text("AssertionError: relative error 0.3 (tolerance 1e-05)\nassert 0.3 < 1e-05\n +  where 0.3 = f()") \
        == "relative error 0.3 (tolerance 1e-05)"
    assert text("AssertionError: \nNot equal to tolerance rtol=0.0001\n\nMismatched elements: 3 / 15") \
        == "Not equal to tolerance rtol=0.0001"
    path = f"{tempfile.gettempdir()}/pytest-of-me/pytest-12/test_x0/bad_json.safetensors"
    assert text(f"TinyVLLMError: {path}: header is not JSON") == \
        "TinyVLLMError: bad_json.safetensors: header is not JSON"
    for note in ("Falsifying example", "Failing test case"):  # what hypothesis adds, by version
        hypothesis = f"AssertionError: can_allocate(17) with 1 free blocks\n{note}: test_x(\n    num_blocks=1,\n)"
        assert text(hypothesis) == "can_allocate(17) with 1 free blocks"
    assert text("Failed: a 5-byte file: accepted") == "a 5-byte file: accepted"  # pytest.fail
    assert len(text("x" * 1000)) <= 240


@pytest.mark.parametrize("impl, earned", [("student", "none"), ("reference", "all")])
def test_grading_chapter_4_for_real(tmp_path, capsys, impl, earned):
    """The untouched stubs score 0 points; the engine's own functions score every point."""
    xml = tmp_path / "grades.xml"
    code = grade_report.main(["--chapters", "4", "--impl", impl, "--junit", str(xml)])
    rows = grade_report.score(xml)
    assert [r.exercise for r in rows] == ["4.1 gemm_params", "4.2 gemm_params_into_slice", "4.3 colmajor_index"]
    assert all(r.cases > 0 for r in rows)
    assert [r.weight for r in rows] == [grade_report.POINTS[4][n] for n in ("gemm_params", "gemm_params_into_slice",
                                                                            "colmajor_index")]
    if earned == "none":
        assert code == 1 and all(r.passed == 0 and r.earned == 0 and r.result.startswith("failed") for r in rows)
    else:
        assert code == 0 and all(r.passed == r.cases and r.earned == r.weight and r.result == "passed" for r in rows)
    assert "total" in capsys.readouterr().out
