"""Every .cu file compiles for Hopper (sm_90) with nvcc, on any machine that has nvcc — no GPU needed —
so a syntax error in a kernel shows up in CI, not on the GPU."""
import shutil
import subprocess
from pathlib import Path

import pytest

KERNELS = sorted((Path(__file__).resolve().parent.parent / "tinyvllm" / "kernels").glob("*.cu"))
NVCC = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))


def test_there_are_kernels():
    assert {"embedding", "rms_norm", "rope", "prefill_attention", "swiglu", "argmax"} <= {k.stem for k in KERNELS}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check kernels)")
@pytest.mark.parametrize("path", KERNELS, ids=[k.stem for k in KERNELS])
def test_kernel_compiles_for_sm90(path, tmp_path):
    run = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
