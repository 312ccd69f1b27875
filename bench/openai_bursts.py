"""Bursts of the official openai client against a running server, as scripts use it: does any request get lost?

Each burst sends --requests chat requests ("Tell me a long story about a robot named R{i}, ...") with at most
--in-flight at once, through a NEW AsyncOpenAI client (max_retries=0) that is never closed, so each burst finds
the last one's connections still open. --pattern says which bursts stream (with include_usage) and which do not;
--leave-streams makes every stream stop reading at its finish chunk without closing (the usage chunk and
[DONE] unread). Prints and writes per burst: requests, failed (with the errors), seconds.

    python -m tinyvllm serve --model default &
    python bench/openai_bursts.py --url http://127.0.0.1:8000 [--pattern stream,nostream] [--requests 256]
        [--in-flight 128] [--max-tokens 128] [--timeout 45] [--leave-streams] [--out PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from bench.gpu_common import write_result  # noqa: E402


async def request(client: openai.AsyncOpenAI, model: str, i: int, stream: bool, args) -> str | None:
    """None when it completed, else the error."""
    chat = dict(model=model, max_tokens=args.max_tokens, temperature=0, messages=[
        {"role": "user", "content": f"Tell me a long story about a robot named R{i}, with many details."}])
    try:
        if not stream:
            await client.chat.completions.create(**chat)
            return None
        events = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat)
        async for chunk in events:
            if args.leave_streams and chunk.choices and chunk.choices[0].finish_reason:
                break
        return None
    except Exception as e:  # noqa: BLE001 - counted and reported, the burst goes on
        return f"{type(e).__name__}: {e}"[:160]


async def burst(args, model: str, stream: bool) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0,
                                timeout=args.timeout)   # never closed, as a script's client per task
    gate = asyncio.Semaphore(args.in_flight)

    async def limited(i: int):
        async with gate:
            return await request(client, model, i, stream, args)
    start = time.monotonic()
    errors = [e for e in await asyncio.gather(*(limited(i) for i in range(args.requests))) if e is not None]
    result = {"stream": stream, "requests": args.requests, "failed": len(errors), "errors": sorted(set(errors))[:5],
              "seconds": round(time.monotonic() - start, 2)}
    print(f"{'stream' if stream else 'no-stream':>9}: {len(errors)} of {args.requests} failed in "
          f"{result['seconds']} s {result['errors'][:2]}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default="none")
    p.add_argument("--pattern", default="stream,nostream,nostream,stream,stream,nostream")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--in-flight", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=45)
    p.add_argument("--leave-streams", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    model = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key).models.list().data[0].id

    async def run():
        return [await burst(args, model, kind == "stream") for kind in args.pattern.split(",")]
    bursts = asyncio.run(run())
    result = {"benchmark": "openai_bursts", "url": args.url, "model": model,
              "command": " ".join(["python", "bench/openai_bursts.py", *sys.argv[1:]]), "bursts": bursts,
              "lost": sum(b["failed"] for b in bursts)}
    print(f"lost {result['lost']} of {sum(b['requests'] for b in bursts)}")
    write_result("openai_bursts", result, args.out)


if __name__ == "__main__":
    main()
