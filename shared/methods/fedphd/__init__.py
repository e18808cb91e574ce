"""FedPhD (seed 000): homogeneity-aware hierarchical aggregation, sparse training and
structured pruning.

Importing the package imports nothing: its settings (``config.py``) are read without torch.
"""
