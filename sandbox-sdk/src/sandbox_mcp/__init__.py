"""sandbox-mcp: the sandbox tool set as a Model Context Protocol server.

Each MCP session gets its own sandbox, created on first use and found again by
a label derived from the caller and the session key; `sandbox-mcp --help`
lists the settings. Installed with `pip install 'sandbox-sdk[mcp]'`.
"""

from sandbox_mcp.settings import Settings

__all__ = ["Settings"]
