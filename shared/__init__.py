"""Estuary's shared library: everything the cloud, edge and device roles have in common.

Subpackages, lowest first (each imports only the ones before it; the roles import this
package and never each other):

- ``errors``, ``atomic``, ``lifetime``: the exception tree, atomic file writes, child processes
  that die with their parent;
- ``config``: the typed run configuration (TOML plus environment overrides) and ``naming``
  (device, edge and topic names derived from it);
- ``wire``: message schemas and the tensor codec; ``transport``: the bus interface, MQTT and
  blob transfer;
- ``models``: U-Net presets, channel plans, pruning, checkpoints; ``data``: datasets and
  partitions;
- ``diffusion``: schedules, the loss, local training; ``algorithms``: one file per federated
  algorithm;
- ``evaluation``: quality metrics, run records, report plots; ``metrics``: Prometheus and
  cost accounting;
- ``runtime``: the role service base and process runner; ``deploy``: ONNX export, signing
  and the torch-free on-device sampler.
"""

__version__ = "0.1.0"
