"""Device agent: trains on private data and uploads updates to its edge server."""

from device_agent.service import DeviceAgent

__all__ = ["DeviceAgent"]
