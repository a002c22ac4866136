"""Schema fuzzing: schemathesis generates requests from the server's own
OpenAPI document (valid and invalid bodies, odd types and sizes). No answer
may be a 5xx, and every answer must be one the document describes (status,
content type, body schema). Examples per operation are few, so this stays
fast; the engine must still be idle with full pools afterwards."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

import api_server

EXAMPLES = 30  # per operation, valid and invalid together
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
# Valid lengths and choice counts are capped: the fuzz is about input handling, not decoding.
MAX_TOKENS, MAX_N = 8, 2


@pytest.fixture(scope="module")
def server():
    return api_server.shared()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_schema_lists_the_api(api_schema):
    ops = {op.ok().label for op in api_schema.get_all_operations()}
    assert ops >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                   "GET /health", "GET /metrics"}


@pytest.mark.parametrize("label", ["POST /v1/completions", "POST /v1/chat/completions",
                                   "GET /v1/models", "GET /health", "GET /metrics"])
def test_no_server_errors(api_schema, server, label):
    (op,) = [o.ok() for o in api_schema.get_all_operations() if o.ok().label == label]

    @given(case=op.as_strategy().map(_short))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.call_and_validate(checks=CHECKS, timeout=30)

    fuzz()
    server.wait_idle()


def _short(case):
    """Caps valid token and choice counts (and sets a token count where the
    default is the whole context), leaving every other generated value, valid
    or not, as it is."""
    if isinstance(case.body, dict):
        for key, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS),
                         ("n", MAX_N)):
            value = case.body.get(key)
            if (value is None and key != "n") or (type(value) is int and value > cap):
                case.body[key] = cap
    return case
