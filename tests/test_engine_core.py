"""The engine core's loop in one process, its sockets replaced by lists: what it sends, in which order."""
from __future__ import annotations

import pickle


from tinyvllm.engine.core_messages import Add, Report, Update, report_from
from tinyvllm.engine.engine import Engine
from tinyvllm.engine.engine_config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.engine.sampling import SamplingParams


class Commands:
    """A PULL socket: hands out the queued commands, then None (shut down) once the engine has no work."""
    def __init__(self, commands: list, engine: Engine):
        self.queue, self.engine = [pickle.dumps(c) for c in commands], engine

    def poll(self, timeout_ms: int) -> bool:
        if not self.queue and not self.engine.has_work():
            self.queue.append(pickle.dumps(None))
        return bool(self.queue)

    def recv(self) -> bytes:
        return self.queue.pop(0)


class Reports:
    """A PUSH socket that keeps what was sent, and notes it in the shared event log."""
    def __init__(self, events: list):
        self.events, self.sent = events, []

    def send(self, data: bytes) -> None:
        self.sent.append(report_from(data))
        self.events.append("report")


def test_a_step_is_reported_while_the_next_one_runs(tiny_model_dir, rng):
    """Every Report of a step goes out after the next step was launched (its kernels hide the
    sending), the last one once nothing is left to launch, and together they carry every token in order."""
    engine = Engine.from_config(EngineConfig(model=str(tiny_model_dir), device="cpu", num_blocks=64))
    events: list[str] = []
    launch, finish = engine.launch_step, engine.finish_step
    engine.launch_step = lambda: events.append("launch") or launch()
    engine.finish_step = lambda launched: events.append("finish") or finish(launched)
    lengths = rng.integers(1, 12, 5).tolist()
    adds = [Add(f"r{i}", rng.integers(0, 1000, int(rng.integers(2, 30))).tolist(),
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]
    reports = Reports(events)
    EngineCore(engine, Commands(adds, engine), [reports]).run()

    steps = events.count("launch")
    assert steps == events.count("finish") == max(lengths) and len(reports.sent) >= steps
    for k in range(1, steps):   # step k's report: after launch k + 1, before finish k + 1
        launched_next = [i for i, e in enumerate(events) if e == "launch"][k]
        assert events[launched_next + 1] == "report", f"step {k}'s report was not sent while step {k + 1} ran"
    got: dict[str, list[int]] = {}
    for report in reports.sent:
        assert isinstance(report, Report) and all(isinstance(u, Update) for u in report.updates)
        for update in report.updates:
            got.setdefault(update.request_id, []).extend(update.token_ids)
    finished = {u.request_id: u.finish_reason for r in reports.sent for u in r.updates if u.finish_reason}
    assert finished == {add.request_id: "length" for add in adds}
    alone = Engine.from_config(EngineConfig(model=str(tiny_model_dir), device="cpu", num_blocks=64))
    for add in adds:   # greedy: each request's tokens equal the same request run by itself
        seq = alone.add_request(add.prompt_ids, add.params)
        while alone.has_work():
            alone.step()
        assert got[add.request_id] == seq.output_ids, add.request_id
    assert reports.sent[-1].stats.running == 0
