"""The secret the router and the workers share: every worker endpoint and the transfer
handshake require it (``Authorization: Bearer <secret>``), so a process that can reach
a worker's ports but was not given the secret can neither drive the worker nor learn the
NIXL metadata that would let it READ or WRITE the worker's cache.

It never appears on a command line (which any local user can read in ``ps``): it comes
from the environment, ``QWEN35_JAX_SECRET`` itself or ``QWEN35_JAX_SECRET_FILE`` naming a
file that holds it. ``python -m serving`` generates one per start and hands it to its
workers in their environment; workers started by hand, or on other hosts, are given the
same value by their operator.
"""

from __future__ import annotations

import hmac
import os
import secrets

ENV = "QWEN35_JAX_SECRET"
ENV_FILE = "QWEN35_JAX_SECRET_FILE"
MIN_LENGTH = 16  # characters: a guessable secret protects nothing


class SecretMissing(RuntimeError):
    """No usable shared secret in the environment."""


def generate() -> str:
    return secrets.token_urlsafe(32)


def load(environ=os.environ) -> str:
    """The shared secret from ``environ``; SecretMissing says how to give one."""
    path = environ.get(ENV_FILE)
    if path:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as e:
            raise SecretMissing(f"cannot read {ENV_FILE}={path}: {e}") from None
    else:
        value = environ.get(ENV, "")
    if len(value) < MIN_LENGTH:
        raise SecretMissing(
            f"the workers need a shared secret of at least {MIN_LENGTH} characters in "
            f"{ENV} or in a file named by {ENV_FILE} (python -m serving makes one itself)")
    return value


def header(secret: str) -> dict[str, str]:
    """The HTTP header that carries ``secret``."""
    return {"Authorization": f"Bearer {secret}"}


def bearer_matches(authorization: str | None, secret: str) -> bool:
    """Whether an ``Authorization`` header value carries ``secret`` (constant time)."""
    given = (authorization or "").encode()
    return hmac.compare_digest(given, header(secret)["Authorization"].encode())
