"""Shipping the trained generator to devices: ONNX export with a parity check against
torch, the signed deployment manifest (Ed25519), and the torch-free sampler that devices
run (ONNX Runtime plus a numpy DDIM loop; ``onnx_sampler`` and ``signing`` never import
torch).
"""
