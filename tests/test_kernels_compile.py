"""Every .cu file compiles for Hopper (sm_90) with nvcc, on any machine that has nvcc — no GPU needed —
so a syntax error in a kernel shows up in CI, not on the GPU. Template kernels are instantiated for the
shapes the engine launches (NVRTC does that at run time from a name expression)."""
import shutil
import subprocess
from pathlib import Path

import pytest

from tinyvllm.model.backend.constants import INVARIANT_GEMM_TILES, nvrtc_defines

pytestmark = pytest.mark.slow   # not in make test-fast: nvcc, seconds a kernel

KERNELS = sorted((Path(__file__).resolve().parent.parent / "tinyvllm" / "model" / "kernels").glob("*.cu"))
NVCC = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))

DECODE_ARGS = ("const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const int*, const int*, "
               "__nv_bfloat16*, int, int, int, float")
PAGED_ARGS = ("const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const int*, int, const int*, "
              "__nv_bfloat16*, int, int, int, float, float*, int")
SHAPES = [(64, 4), (128, 3), (128, 4), (64, 3), (16, 1), (32, 2), (128, 8)]
INSTANCES = {  # (head_dim, query heads per K/V head): Llama 3.2 1B/3B, 3.1 8B, SmolLM2, the tests' shapes
    "decode_attention": [f"template __global__ void decode_attention<{d}, {g}>({DECODE_ARGS});\n"
                         for d, g in SHAPES],
    "paged_attention": [f"template __global__ void paged_attention<{d}, {g}>({PAGED_ARGS});\n" for d, g in SHAPES]
    + [f"template __global__ void merge_splits<{d}>(const float*, int, const int*, int, __nv_bfloat16*, int);\n"
       for d in (32, 64, 128)],
    "gemv": [f"template __global__ void gemv<{n}, {f}>(const __nv_bfloat16*, const __nv_bfloat16*, void*, int, int, "
             f"int);\n" for n in range(1, 9) for f in ("true", "false")],
    "gemm_invariant": [f"template __global__ void gemm_invariant<{t.warps_m}, {t.warps_n}, {t.tm}, {t.tn}, {t.bk}, "
                       f"{t.row_stride}, {t.stages}, {f}>(const __nv_bfloat16*, const __nv_bfloat16*, void*, int, int, "
                       f"int, int);\n" for _, t in INVARIANT_GEMM_TILES for f in ("true", "false")],
    "fused_decode": [f"template __global__ void rms_norm_gemv<{n}, {f}>(const float*, const __nv_bfloat16*, "
                     f"const __nv_bfloat16*, void*, float, int, int, int);\n" for n in (1, 8) for f in ("true", "false")]
    + [f"template __global__ void gemv_add<{n}>(const __nv_bfloat16*, const __nv_bfloat16*, float*, int, int);\n"
       for n in (1, 8)],
    "decode_persistent": [f"template __global__ void decode_persistent<{n}, {d}, {g}>(const long long*, int, "
                          f"unsigned*, unsigned long long*);\n" for n in (1, 2, 8) for d, g in SHAPES],
}


def test_there_are_kernels():
    assert {"embedding", "rms_norm", "rope", "prefill_attention", "swiglu", "argmax", "store_kv",
            "decode_attention", "paged_attention", "gemv", "decode_persistent"} <= {k.stem for k in KERNELS}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check kernels)")
@pytest.mark.parametrize("path", KERNELS, ids=[k.stem for k in KERNELS])
def test_kernel_compiles_for_sm90(path, tmp_path):
    source = tmp_path / path.name
    source.write_text(f'#include "{path}"\n' + "".join(INSTANCES.get(path.stem, [])))
    run = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", f"-I{path.parent}", *nvrtc_defines(), "-c", str(source),
                          "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check kernels)")
def test_fused_decode_refuses_a_norm_of_other_threads_than_add_rms_norm(tmp_path):
    """fused_decode.cu's norm gives add_rms_norm's bits only with as many threads (GEMV_THREADS == ROWS): another
    ROWS stops the compiler at its static_assert, not the tests at differing bits."""
    path = KERNELS[0].parent / "fused_decode.cu"
    defines = [d for d in nvrtc_defines() if not d.startswith("-DROWS=")] + ["-DROWS=128"]
    run = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", f"-I{path.parent}", *defines, "-cubin", str(path),
                          "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert run.returncode != 0 and "add_rms_norm's order only with ROWS threads" in run.stderr, run.stderr
