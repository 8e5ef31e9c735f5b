"""The E2B adapter: E2B's SDKs, unchanged, against this operator's Sandboxes.

It is a second listener of the gateway (off unless `e2b_port` is set) and
translates; nothing in the sandbox speaks E2B. One listener serves both of
E2B's planes, told apart by the request:

    control plane (E2B_API_URL)      X-API-KEY; /sandboxes, /v2/sandboxes...   control.py
    data plane (E2B_SANDBOX_URL, or  E2b-Sandbox-Id and E2b-Sandbox-Port
      host {port}-{id}.{domain})       headers, or the host; X-Access-Token
        port 49983, the daemon       Connect RPC (JSON): process, filesystem   process.py,
                                     HTTP /files, /health, /envs               filesystem.py
        port 49999, interpreter      /execute, /contexts                       interpreter.py

core.py holds what every part shares: the sandbox ID <-> Sandbox mapping,
the per-sandbox access token, the call into a sandbox's agent, and E2B's
error shapes. Protocol facts come from E2B's published specs; see
docs/e2b.md for what is served and what differs.
"""
