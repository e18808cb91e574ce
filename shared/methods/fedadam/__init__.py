"""FedAdam and FedYogi (Reddi et al., ICLR 2021, "Adaptive Federated Optimization"): the
cloud treats the averaged update as a pseudo-gradient for an adaptive optimizer of its own.

Importing the package imports nothing: its settings (``config.py``) are read without torch.
"""
