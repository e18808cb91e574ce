"""Estuary's shared library: everything the cloud, edge and device roles have in common.

Modules: ``config`` (typed run configuration), ``data`` and ``partition`` (datasets and
non-IID splits), ``models`` (U-Net presets), ``diffusion`` (DDPM loss, DDIM sampling),
``codec`` (safetensors + sha256), ``messages`` (versioned wire schemas), ``aggregation``
(pure maths), ``bus`` (transport interface and MemoryBus), ``algorithms`` (one file per
federated algorithm), ``quality`` (FID and friends), ``report`` (plots).
"""

__version__ = "0.1.0"
