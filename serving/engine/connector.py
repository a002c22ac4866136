"""The interface a disaggregated worker plugs into the engine loop (the part vLLM v1's KV
connector plays): the loop calls the connector, so a worker hands the loop no callables
and reads no engine internals.

The loop (``serving.async_engine.AsyncEngine``) calls, all on the engine thread:

* ``admit(engine, request_id, prompt, params, **kw)`` when a request is added: the
  worker's way in (the prefill side holds the request's memory for a lease when it
  finishes; the decode side queues it for memory that a transfer fills). It raises to
  refuse the request, as ``Engine.add_request`` does.
* ``tick(engine)`` before every iteration, and on an idle engine when woken
  (``AsyncEngine.wake``): transfer events in (leases freed, READs landed, pulls done),
  pulls out, through the engine's transfer methods (``reserve_transfers``,
  ``finish_transfer``, ``confirm_transfer``, ``abandon_transfer``, ``free_memory``,
  ``held_memory``, ``release``, ``abort``).
* ``on_stop(error)`` once, when the loop stops, after every stream has been failed:
  to end what only the engine thread would have ended.

The default connector is the aggregated engine's: a plain ``add_request``, no tick.
"""

from __future__ import annotations


class EngineConnector:
    def admit(self, engine, request_id: str, prompt: list[int], params, **kw) -> None:
        if kw:
            raise TypeError(f"unexpected admission arguments {sorted(kw)}")
        engine.add_request(prompt, params, request_id)

    def tick(self, engine) -> None:
        """Between steps: apply what happened outside the engine."""

    def on_stop(self, error: BaseException) -> None:
        """The engine loop stopped with ``error``."""
