"""Datasets and how they are split across devices: Fashion-MNIST from its IDX files, a
synthetic set for tests, image folders (one per device, or one split across devices), and
the seeded partitions (IID, Dirichlet, k classes, shards, quantity skew, dominant classes)
with their label-count matrices.
"""
