"""FedDEO (seed 003): one-shot learning from the devices' descriptions and a classifier
trained on the cloud's synthetic set.

Importing the package imports nothing: its settings (``config.py``) are read without torch.
"""
