"""``python tests/fault_worker.py``: ``python -m serving.worker`` (same flags) whose NIXL
agent injects faults (`faulty_agent.FaultyAgent`), with one more route:

    POST /debug/faults  {"fail_next": n, "hang_next": m}: the next n pulls fail, the m
                        after them are never posted (they time out)
    POST /debug/crash   the engine's next step raises (its engine thread stops)

so the disaggregated tests break a transfer inside a real worker process.
"""

from pydantic import BaseModel, ConfigDict, Field

from faulty_agent import FaultyAgent
from serving.worker.__main__ import load_worker, parser, serve, shared_secret


class Faults(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    fail_next: int = Field(0, ge=0)
    hang_next: int = Field(0, ge=0)


def main():
    from serving.worker.app import build_app
    from transfer import Agent

    a = parser().parse_args()
    secret = shared_secret()
    worker = load_worker(a, secret, agent_type=lambda *r, **kw: FaultyAgent(Agent(*r, **kw)))
    app = build_app(worker, secret=secret, max_body_bytes=a.max_request_bytes)

    @app.post("/debug/faults")
    async def faults(body: Faults):
        worker.agent.fail_next, worker.agent.hang_next = body.fail_next, body.hang_next
        return {"ok": True}

    @app.post("/debug/crash")
    async def crash():
        def step():
            raise RuntimeError("injected engine crash")
        worker.engine.engine.step = step
        worker.engine.engine.has_steps = lambda: True
        worker.engine.wake()
        return {"ok": True}

    serve(worker, app, a)


if __name__ == "__main__":
    main()
