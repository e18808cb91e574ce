"""The wire format: versioned message schemas (pydantic) and the tensor codec (safetensors
plus sha256). Everything that crosses a process boundary is defined here and nowhere else:
topic strings, message kinds, limits on what a message may carry, and how tensors become
bytes and back. Torch-free: a sampling-only device imports it without the training extra
(the codec imports torch only inside the functions that encode or decode tensors).
"""
