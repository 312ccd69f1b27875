"""bench/kernel_bench.py, the kernel workbench, on the CPU: its command line refuses a mistake in one line with exit
code 2 before it needs a GPU, --list names every kernel, and without CuPy it says so in one line; its default shapes keep
each kernel's layout rules; --define reaches every module that reads the constants; and each family's dynamic
shared memory comes from one function. The runs themselves need a GPU: python bench/kernel_bench.py all.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernel_bench import KERNELS, parse_shapes
from tests.test_cli import assert_user_error  # exit 2, one line on stderr, no traceback: the CLI's rule
from tinyvllm.model.backend.constants import (
    DECODE_HEAD_DIMS,
    GEMV_MAX_ROWS,
    INVARIANT_CHUNK,
    PREFILL_HEAD_DIMS,
    norm_gemv_smem,
    prefill_smem,
)

ROOT = Path(__file__).resolve().parent.parent
DECODE_KERNELS = {"gemv", "rms_norm_gemv", "rms_norm_gemv_swiglu", "gemv_add", "rope_store_kv", "decode_attention",
                  "paged_attention", "add_rms_norm"}


@pytest.fixture
def no_cupy(tmp_path) -> Path:
    """A folder whose `cupy` fails to import: first on PYTHONPATH, it stands for a machine without CuPy."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text('raise ImportError("CuPy hidden by tests/test_bench_kernels.py")\n')
    return tmp_path


def workbench(*args: str, no_cupy: Path) -> subprocess.CompletedProcess:
    """python bench/kernel_bench.py ARGS as a user runs it, on a machine without CuPy."""
    path = [str(no_cupy), str(ROOT), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    return subprocess.run([sys.executable, "bench/kernel_bench.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_list_names_every_kernel(no_cupy):
    run = workbench("--list", no_cupy=no_cupy)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    names = {line.split()[0] for line in run.stdout.splitlines() if line and not line[0].isspace()}
    assert names == set(KERNELS) and DECODE_KERNELS <= names


@pytest.mark.parametrize("args, words", [
    (["nosuch"], ["unknown kernel 'nosuch'", "gemv"]),
    (["gemv", "nosuch"], ["unknown kernel 'nosuch'"]),
    (["gemv", "--define", "NOPE=3"], ["unknown --define constant 'NOPE'", "GEMV_LOADS"]),
    (["gemv", "--define", "GEMV_MAX_ROWS"], ["NAME=VALUE"]),
    (["gemv", "--define", "GEMV_LOADS=four"], ["positive integer"]),
    (["gemv", "--shapes", "1x2056"], ["gemv takes T x K x N x f32"]),
    (["gemv", "gemv_add", "--shapes", "1x2056x1000x0"], ["one kernel"]),
    (["gemv", "--repeat", "0"], ["--repeat", "positive integer"]),
    (["gemv", "--bogus"], ["--bogus"]),
    ([], ["name a kernel"]),
])
def test_mistakes_are_one_line_and_exit_2(no_cupy, args, words):
    assert_user_error(workbench(*args, no_cupy=no_cupy), *words)


@pytest.mark.parametrize("args", [["gemv"], ["all", "--define", "GEMV_LOADS=8", "--repeat", "5"],
                                  ["paged_attention", "--define", "BLOCK_SIZE=32", "--shapes", "3x9x3x128x1001x16"]])
def test_without_cupy_it_says_so_in_one_line(no_cupy, args):
    """Well-formed commands get as far as the GPU, and stop there: one line, exit 2."""
    assert_user_error(workbench(*args, no_cupy=no_cupy), "CuPy", "NVIDIA GPU")


def test_default_shapes_keep_the_layout_rules():
    """The defaults are odd sizes, but within what each launcher accepts (a wrong one would fail on the GPU only)."""
    for name, k in KERNELS.items():
        assert parse_shapes(name, ["x".join(map(str, s)) for s in k.shapes]) == list(k.shapes), name
        for shape in k.shapes:
            s = dict(zip(k.fields, shape))
            if "K" in s:   # gemv and the fused layer: 16-byte loads of whole rows
                assert s["K"] % 8 == 0 and s["K"] & (s["K"] - 1), (name, shape)
            if name == "gemm_invariant":   # whole chunks of k
                assert s["K"] % INVARIANT_CHUNK == 0, (name, shape)
            elif "K" in s:
                assert 1 <= s["T"] <= GEMV_MAX_ROWS, (name, shape)
            if "head_dim" in s:
                assert s["head_dim"] in (PREFILL_HEAD_DIMS if "start" in s or name == "prefill_attention"
                                         else DECODE_HEAD_DIMS), (name, shape)
                assert s["heads"] % s["kv_heads"] == 0, (name, shape)


def test_defines_reach_the_launchers_the_twins_and_the_compiler():
    """In a fresh process (it changes module state): a given constant, the one derived from it, the twins' chunking
    and paged layout, and the -D options all take the new values; cuda_ops is imported after them."""
    code = ("from bench.kernel_bench import set_constants\n"
            "print(set_constants({'GEMV_COLUMNS_PER_BLOCK': 4, 'BLOCK_SIZE': 32, 'DECODE_THREADS': 128}))\n"
            "from tinyvllm.model.backend import constants, numpy_ops\n"
            "print(' '.join(constants.nvrtc_defines()))\n"
            "print(numpy_ops.BLOCK_SIZE, constants.decode_thread_groups(64), constants.GEMV_THREADS)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    changed, defines, values = run.stdout.splitlines()
    assert "GEMV_THREADS=128 (derived)" in changed and "BLOCK_SIZE=32 (given)" in changed
    assert {"-DGEMV_COLUMNS_PER_BLOCK=4", "-DGEMV_THREADS=128", "-DBLOCK_SIZE=32", "-DDECODE_THREADS=128"} <= set(
        defines.split())
    assert values.split() == ["32", "16", "128"]


def test_shared_memory_sizes_come_from_one_function_per_family():
    assert prefill_smem(128) == 102 * 1024   # the Q tile and 2 x (K + V), rows of 128 + 8: constants.py's "102 KiB"
    variant = {"PREFILL_TILE": 64, "PREFILL_KV_STAGES": 2, "PREFILL_KEY_TILE": 64, "PREFILL_SMEM_PAD": 8}
    assert prefill_smem(64, variant) == (64 + 4 * 64) * 72 * 2   # bench/attention_tiles.py's variants
    assert norm_gemv_smem(8, 4096) == 64 * 1024   # Llama 3.1 8B at 8 rows: past the 48 KiB a launch gets unasked
