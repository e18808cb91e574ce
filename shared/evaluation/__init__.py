"""Judging a global model: sample grids and quality metrics (FID, IS, precision/recall,
density/coverage) on features of a shipped Fashion-MNIST classifier, the per-round run
recorder (``metrics.jsonl``, checkpoints, grids) and the report plots.
"""
