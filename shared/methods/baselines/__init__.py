"""The baselines the seeds compare against: FedAvg (and FedAvg(E=1)), FedProx, SCAFFOLD,
MOON and Local-only.

Importing the package imports nothing: its settings (``config.py``) are read without torch.
"""
