"""Model architectures and their files: the U-Net presets and their sizes, a run's first
weights (random, shipped pretrained, or a file), channel plans (a pruned architecture as
JSON every role rebuilds), structured pruning with Torch-Pruning's dependency groups, and
atomic checkpoints.
"""
