"""bench/serving.py: its figures follow `vllm bench serve`'s definitions, and a smoke run on the tiny model goes
through the official openai client end to end (server, offline engine, client processes, result file)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving import request_times, slo_pair, summarize

ROOT = Path(__file__).resolve().parent.parent


def result(start: float, ttft: float | None, end: float, tokens: int, itl: list[float] = (),
           error: str | None = None) -> dict:
    """One request's record as the client processes return it (seconds on one clock; no TTFT without streaming)."""
    return {"index": 0, "max_tokens": tokens, "start": start, "ttft": ttft, "last": None, "itl": list(itl),
            "prompt_tokens": 10, "completion_tokens": tokens, "error": error, "end": end}


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert request_times(result(1.0, 0.2, 1.6, 5)) == pytest.approx({"ttft": 0.2, "tpot": 0.1, "e2el": 0.6})
    assert request_times(result(1.0, 0.2, 1.2, 1))["tpot"] == 0.0   # one token: vLLM's 0, within any TPOT bound
    assert request_times(result(1.0, None, 1.5, 5)) == {"ttft": None, "tpot": None, "e2el": 0.5}


def test_counts_throughputs_and_goodput():
    results = [result(0.0, 0.1, 1.0, 10, [0.1] * 9),    # TTFT 100 ms, TPOT 100 ms
               result(0.0, 0.5, 2.0, 16, [0.1] * 15),   # TTFT 500 ms, TPOT 100 ms
               result(1.0, 0.1, 1.2, 2, [0.1]),         # TTFT 100 ms, TPOT 100 ms, E2EL 200 ms
               result(0.5, None, 0.6, 0, error="HTTP 500")]
    row = summarize(results, True, {"ttft": 200, "tpot": 150})
    assert (row["requests"], row["completed"], row["failed"]) == (4, 3, 1)
    assert row["duration_s"] == 2.0   # the first request sent to the last response read
    assert (row["total_input_tokens"], row["total_output_tokens"]) == (30, 28)
    assert (row["input_throughput"], row["output_throughput"], row["total_token_throughput"]) == (15, 14, 29)
    assert row["request_throughput"] == 1.5
    assert row["request_goodput"] == 1.0   # two of the three within both bounds, over 2 s
    assert summarize(results, True, {"e2el": 250})["request_goodput"] == 0.5
    assert summarize(results, True, {})["request_goodput"] is None
    assert row["ttft_ms"]["median"] == pytest.approx(100)
    assert row["ttft_ms"]["std"] == pytest.approx(188.56, abs=0.01)   # the population's, as numpy's and vLLM's
    assert row["itl_ms"] == pytest.approx({"mean": 100, "median": 100, "std": 0, "p90": 100, "p99": 100})
    assert row["e2el_ms"]["p90"] == pytest.approx(1800)


def test_goodput_without_streaming_bounds_only_the_latency():
    results = [result(0.0, None, 0.3, 4), result(0.0, None, 0.6, 4)]
    assert summarize(results, False, {"ttft": 200})["request_goodput"] is None   # no chunk marks a first token
    assert summarize(results, False, {"e2el": 400})["request_goodput"] == pytest.approx(1 / 0.6)


def test_slo_pairs_are_vllms():
    assert slo_pair("ttft:500") == ("ttft", 500.0)
    for wrong in ("ttft", "ttft:", "latency:5", "tpot:-1", "tpot:fast", "e2el:nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            slo_pair(wrong)


@pytest.mark.slow   # a served engine and the official client
def test_smoke_run_through_the_openai_client(tiny_model_dir, tmp_path):
    out = tmp_path / "serving.json"
    run = subprocess.run(
        [sys.executable, "bench/serving.py", "--device", "cpu", "--model", str(tiny_model_dir), "--num-requests", "8",
         "--concurrency", "4", "--input-len", "16", "--output-len", "8", "--rounds", "1", "--client-processes", "1",
         "--client", "openai", "--goodput", "ttft:60000", "tpot:60000", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workload"]["client"] == "openai" and report["machine"]["host"]["openai"]
    stream, plain = report["rounds"][0]["stream"], report["rounds"][0]["no-stream"]
    for row in (stream, plain):
        assert (row["completed"], row["failed"], row["total_output_tokens"]) == (8, 0, 64)
        assert row["total_input_tokens"] == 8 * 16 and row["e2el_ms"]["p99"] > 0
    assert stream["request_goodput"] == pytest.approx(stream["request_throughput"])   # bounds of a minute: all good
    assert stream["ttft_ms"] and stream["tpot_ms"] and stream["itl_ms"]
    assert plain["request_goodput"] is None and plain["ttft_ms"] is None
    assert report["over_rounds"]["stream"]["output_throughput"]["median"] == stream["output_throughput"]
    assert set(report["http_over_offline"]) == {"stream", "no-stream"}
