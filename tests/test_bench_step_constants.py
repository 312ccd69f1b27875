"""bench/step_constants.py on the CPU: the decode step timed with each setting of a kernel constant in turn, in one
process (a process of its own here: the settings change the constants of the process that runs them). Its GPU runs are
chapter 8's (python bench/step_constants.py --define GEMV_LOADS=4 --define GEMV_LOADS=2)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_cli import assert_user_error

ROOT = Path(__file__).resolve().parent.parent


def step_constants(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/step_constants.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_each_setting_is_timed_every_round(tiny_llama_dir, tmp_path):
    out = tmp_path / "r.json"
    run = step_constants("--model", str(tiny_llama_dir), "--device", "cpu", "--define", "DECODE_THREADS=128",
                         "--define", "DECODE_THREADS=256", "--batches", "1,3", "--context", "20", "--steps", "2",
                         "--rounds", "2", "--out", str(out))
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    expected = {f"DECODE_THREADS={t}, batch {b}, {layer}" for t in (128, 256) for b in (1, 3)
                for layer in ("unfused", "engine")}
    assert set(rows) == expected
    for key, row in rows.items():
        assert len(row["runs"]) == 2 and all(ms > 0 for ms in row["runs"]), key
        assert min(row["runs"]) <= row["ms_per_step"] <= max(row["runs"]), key


def test_a_wrong_define_is_one_line_before_any_model(tmp_path):
    run = step_constants("--model", str(tmp_path / "none"), "--define", "NOPE=2", "--define", "GEMV_LOADS=2")
    assert_user_error(run, "unknown --define constant 'NOPE'")
