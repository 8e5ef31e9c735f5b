"""Prometheus metrics of the gateway, served on its own port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "sandbox_gateway_requests_total",
    "Requests by operation and HTTP status.",
    ["operation", "status"],
)
REQUEST_SECONDS = Histogram(
    "sandbox_gateway_request_seconds",
    "Time to the response's headers, by operation (streams go on after).",
    ["operation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30),
)
IN_FLIGHT = Gauge(
    "sandbox_gateway_requests_in_flight", "Requests being served now (streams included)."
)
REVIEWS = Counter(
    "sandbox_gateway_reviews_total",
    "TokenReviews and SubjectAccessReviews sent to the API server (cache misses).",
    ["kind"],
)
CACHE_HITS = Counter(
    "sandbox_gateway_review_cache_hits_total",
    "Answers served from the review caches.",
    ["kind"],
)
RESUMES = Counter("sandbox_gateway_resumes_total", "Idle-paused sandboxes resumed for a request.")
UPSTREAM_ERRORS = Counter(
    "sandbox_gateway_upstream_errors_total",
    "Agents or preview ports that could not be reached or broke off.",
)
ROUTES = Gauge("sandbox_gateway_routes", "Sandboxes in the route table.")
CONNECTIONS = Gauge("sandbox_gateway_connections", "Client connections open now.")
CONNECTIONS_OPENED = Counter(
    "sandbox_gateway_connections_opened_total",
    "Client connections accepted. Growing as fast as the requests: clients that do"
    " not keep their connections (each new one is a TCP, often a TLS, handshake).",
)
CONNECTIONS_CLOSED = Counter(
    "sandbox_gateway_connections_closed_total",
    "Client connections the gateway closed itself: a request head or the next request"
    " not sent in time (deadline), or a connection over a limit (limit).",
    ["reason"],
)
STREAMS_INTERRUPTED = Counter(
    "sandbox_gateway_streams_interrupted_total",
    "Event streams ended with an 'interrupted' event: the agent's broke off, or shutdown.",
    ["reason"],
)
