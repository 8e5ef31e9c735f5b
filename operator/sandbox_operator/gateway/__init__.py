"""sandbox-gateway: authenticated access to every sandbox's agent, for services and people.

Callers present a Kubernetes token (checked with TokenReview, then
SubjectAccessReview on `sandboxes/exec`, `sandboxes/files`, `sandboxes/ports`)
or a scoped token the gateway minted; the gateway strips their credentials,
injects the sandbox's own agent token and streams both ways. Which sandbox
lives where comes from a watch-fed route table: no API request per call.

config.py  settings          table.py   the route table (watches)
access.py  who may do what   signing.py scoped tokens and signed URLs
proxy.py   streaming to agents and preview ports
app.py     the HTTP surface  __main__.py  `python -m sandbox_operator.gateway`
"""
