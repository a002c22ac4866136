"""The failures a backend (the aggregated engine, the router) and the workers report, in
one module that each side imports; the OpenAI server maps them to HTTP statuses
(``serving.api.generate``): a ``ValueError`` is the client's mistake (400), these are
the server's.
"""


class EngineOverloaded(RuntimeError):
    """Too many requests are queued; retry later (503)."""


class EngineDead(RuntimeError):
    """The engine thread stopped after an error; nothing more will be served (500)."""


class EngineStalled(EngineDead):
    """An engine iteration ran past its bound (a hung device or a deadlocked call): the
    engine is given up as dead, its requests end with this error."""


class Unavailable(RuntimeError):
    """No worker of a role the request needs is live now (503): the router answers at
    once instead of prefilling a request that no decode worker could take."""


class WorkerFailed(RuntimeError):
    """A worker did not answer (died, hung or closed the connection) for this request."""


class TransferFailed(RuntimeError):
    """The request's KV/state transfer failed; the message says how."""
