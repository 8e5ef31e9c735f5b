"""The SDK's implementation, written once as async code; `sandbox_sdk._sync` is
generated from it by `python -m sandbox_sdk._unasync` (a test fails when stale)."""
