"""Device agent: trains on private data and uploads updates to its edge server, and serves
the deployed compact generator (ONNX Runtime, no torch needed to sample).

``DeviceAgent`` (training) is imported lazily so that ``device_agent.sampling`` and the
sampling-only agent load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from device_agent.service import DeviceAgent

__all__ = ["DeviceAgent"]


def __getattr__(name: str) -> Any:
    if name == "DeviceAgent":
        from device_agent.service import DeviceAgent

        return DeviceAgent
    raise AttributeError(f"module 'device_agent' has no attribute {name!r}")
