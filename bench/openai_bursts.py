"""Bursts of the official openai client against a running server, as scripts use it: does any request get lost?

Each burst sends --requests chat requests ("Tell me a long story about a robot named R{i}, ...") with at most
--in-flight at once, through a NEW AsyncOpenAI client (max_retries=0) that is never closed, so each burst finds
the last one's connections still open. The clients stay referenced: with --drop-clients each is garbage once
its burst is done, as a client made per task is, and the openai package's __del__ then closes it in a task of
the running loop; some requests of the next client then never complete although the server answered them all
(its access log shows each within seconds) — a fault of the client process, which keeping the client or
`await client.close()` avoids. --pattern says which bursts stream (with include_usage) and which do not;
--leave-streams makes every stream stop reading at its finish chunk without closing (the usage chunk and
[DONE] unread: output tokens are then the chunks that carried text, input tokens are not counted). Prints and
writes per burst: completed, failed (with the errors), seconds, and bench/serving.py's figures (throughputs,
TTFT, TPOT, ITL, E2EL).

The requests, the client per burst and the figures are bench/serving.py's (`--client openai`); what this script
adds is the pattern: one process, bursts back to back against a server that someone started with whatever
flags, without the offline runs that serving.py puts between its rounds (an idle gap longer than the server's
keep-alive timeout closes the earlier clients' connections, which is part of what is probed here).

    python -m tinyvllm serve --model default &
    python bench/openai_bursts.py --url http://127.0.0.1:8000 [--pattern stream,nostream] [--requests 256]
        [--in-flight 128] [--max-tokens 128] [--timeout 45] [--leave-streams] [--api-key KEY] [--out PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from bench.gpu_common import write_result  # noqa: E402
from bench.serving import ROUTES, ClientSpec, Job, request_body, send_all, summarize  # noqa: E402


def story_jobs(args, model: str, stream: bool) -> list[Job]:
    return [Job(i, 0.0, args.max_tokens, request_body(
        "chat", [{"role": "user", "content": f"Tell me a long story about a robot named R{i}, with many details."}],
        args.max_tokens, stream, False, model)) for i in range(args.requests)]


async def burst(args, spec: ClientSpec, model: str, stream: bool) -> dict:
    """One burst through a new client (send_all makes it, and never closes it)."""
    row = {"stream": stream} | summarize(await send_all(spec, story_jobs(args, model, stream), args.in_flight),
                                         stream, {})
    e2el = row["e2el_ms"]
    print(f"{'stream' if stream else 'no-stream':>9}: {row['failed']} of {row['requests']} failed in "
          f"{row['duration_s']:.2f} s, {row['output_throughput']:,.1f} output tok/s, E2EL median "
          f"{e2el['median'] if e2el else float('nan'):.1f} ms {row['error_examples'][:2]}", flush=True)
    return row


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
    p.add_argument("--drop-clients", action="store_true",
                   help="let each burst's client be garbage-collected unclosed (a client made per task): the openai "
                        "package then closes it in a task, and the next client loses requests (client-side)")
    p.add_argument("--out")
    args = p.parse_args()
    model = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key).models.list().data[0].id
    spec = ClientSpec("openai", args.url, ROUTES["chat"], args.timeout, args.leave_streams, args.api_key,
                      args.drop_clients)

    async def run() -> list[dict]:   # one event loop for every burst: the earlier clients stay alive, as in a script
        return [await burst(args, spec, model, kind == "stream") for kind in args.pattern.split(",")]
    bursts = asyncio.run(run())
    result = {"benchmark": "openai_bursts", "url": args.url, "model": model, "openai": openai.__version__,
              "command": shlex.join(["python", "bench/openai_bursts.py", *sys.argv[1:]]), "bursts": bursts,
              "lost": sum(b["failed"] for b in bursts)}
    print(f"lost {result['lost']} of {sum(b['requests'] for b in bursts)}")
    write_result("openai_bursts", result, args.out)


if __name__ == "__main__":
    main()
