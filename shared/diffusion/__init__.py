"""Diffusion maths and local training: the DDPM/DDIM schedules, the noise-prediction loss
and sampling, the device's local training loop, the hooks algorithms add to it, and the
optional CUDA-graph replay of a training step.
"""
