"""pFedGPA (seed 004): personalized classifiers from a latent diffusion model over the
devices' parameters.

Importing the package imports nothing: its settings (``config.py``) are read without torch.
"""
