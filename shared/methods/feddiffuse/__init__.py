"""FedDiffuse (seed 001): FEDDIFF and its partial-model variants USPLIT, ULATDEC and UDEC.

Importing the package imports nothing: its settings (``config.py``) are read without torch.
"""
