"""The request boundary of kvpool's HTTP services (``kvpool serve`` and ``kvpool router``).

Everything a request meets before an endpoint's own code, shared by both servers:

- :mod:`~kvpool.httpserve.limits`: body size, connection cap, keep-alive / head and body
  timeouts (:class:`HttpLimits`);
- :mod:`~kvpool.httpserve.connections`: aiohttp's low-level server with a connection cap (a
  JSON 503 past it) and JSON answers for what aiohttp refuses itself (malformed HTTP);
- :mod:`~kvpool.httpserve.dispatch`: the endpoint table, bearer auth, ``Expect:
  100-continue``, JSON 404 / 405 / 500, one log line per dropped client, responses counted by
  status;
- :mod:`~kvpool.httpserve.body`: bodies read under the size limit and the body timeout;
- :mod:`~kvpool.httpserve.jsondoc`: JSON decoded with a depth limit, large bodies off the
  event loop;
- :mod:`~kvpool.httpserve.shapes`: the error body of each service (OpenAI's, the router's);
- :mod:`~kvpool.httpserve.auth`, :mod:`~kvpool.httpserve.ratelog`: the bearer token, a
  rate-limited log.
"""

from kvpool.httpserve.auth import bearer_token
from kvpool.httpserve.body import read_body
from kvpool.httpserve.connections import GuardedServer, listen
from kvpool.httpserve.dispatch import Dispatcher, Endpoints, Handler, ResponseCounts
from kvpool.httpserve.jsondoc import MAX_JSON_DEPTH, OFFLOAD_BYTES, check_depth, decode_json
from kvpool.httpserve.limits import DEFAULT_MAX_BODY_BYTES, MAX_PROMPT_TOKENS, HttpLimits
from kvpool.httpserve.shapes import OPENAI_ERRORS, ROUTER_ERRORS, ErrorShape

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_PROMPT_TOKENS",
    "OFFLOAD_BYTES",
    "OPENAI_ERRORS",
    "ROUTER_ERRORS",
    "Dispatcher",
    "Endpoints",
    "ErrorShape",
    "GuardedServer",
    "Handler",
    "HttpLimits",
    "ResponseCounts",
    "bearer_token",
    "check_depth",
    "decode_json",
    "listen",
    "read_body",
]
