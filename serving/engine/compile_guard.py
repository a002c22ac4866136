"""Counts XLA compilations, and shouts about the ones that happen while serving.

Every program the engine runs is compiled at start-up over a fixed set of
padded shapes. A compile inside a serving step means a shape escaped the
buckets (or some host-side jnp op slipped into the loop): it stalls every
request for seconds on a large model, so it is logged at ERROR level and
counted, and tests assert the count stays zero. The hook is JAX's own
backend-compile event, so it also sees compiles that bypass the runner; it
attributes a compile to this engine only while the engine is inside warm-up
or a step, so compiles of other code in the process are not miscounted.
"""

import contextlib
import logging

from jax import monitoring

log = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_active: list["CompileCounter"] = []
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        for c in _active:
            c._record(kwargs.get("fun_name", "?"), duration)


class CompileCounter:
    def __init__(self):
        global _installed
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True
        self.warmup_compiles = 0
        self.warmup_seconds = 0.0
        self.serving_compiles = 0
        self._phase: str | None = None  # "warmup", "serving", or None (not ours)
        _active.append(self)

    @contextlib.contextmanager
    def phase(self, name: str):
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    def _record(self, fun_name: str, duration: float) -> None:
        if self._phase == "serving":
            self.serving_compiles += 1
            log.error("COMPILE DURING SERVING #%d: %s took %.2f s -- a shape escaped the "
                      "start-up buckets", self.serving_compiles, fun_name, duration)
        elif self._phase == "warmup":
            self.warmup_compiles += 1
            self.warmup_seconds += duration

    def close(self) -> None:
        if self in _active:
            _active.remove(self)
