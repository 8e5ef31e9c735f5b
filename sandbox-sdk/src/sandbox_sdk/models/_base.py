"""The base of every model the SDK reads from or sends to the server."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Python names in code (`pod_ip`), the server's names on the wire (`podIP`).

    Unknown fields are kept rather than refused: a newer operator or agent may
    send fields this SDK does not know yet, and they must survive a read."""

    model_config = ConfigDict(populate_by_name=True, extra="allow", defer_build=True)

    def to_wire(self) -> dict[str, Any]:
        """The JSON the server expects: wire names, only the fields that were set (the
        server fills in its own defaults)."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude_unset=True, mode="json")
