"""Federated methods, one package each (``baselines/`` holds FedAvg, FedProx, SCAFFOLD, MOON
and Local-only), every one with its device-side and server-side parts, its settings
(``config.py``, torch-free), and the maths, models and command-line verbs that are its own.

The roles know a method only through the interface (:mod:`shared.methods.api`) and find it
by name in the registry (:mod:`shared.methods.registry`); the pure aggregation maths the
methods share live in :mod:`shared.methods.aggregation`. Importing this package imports
nothing else (a sampling-only device reads every method's settings without torch).
"""
