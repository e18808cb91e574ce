"""PRISM (seed 002): stochastic binary masks over a frozen random generator, its key and
its compact artifact.

Importing the package imports nothing: its settings (``config.py``) are read without torch.
"""
