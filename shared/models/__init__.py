"""Model architectures and their files: the U-Net presets and their sizes, a run's first
weights (random, shipped pretrained, or a file), channel plans (a pruned architecture as
JSON every role rebuilds), structured pruning with Torch-Pruning's dependency groups,
atomic checkpoints, and masked models over frozen random weights derived from a secret key
(PRISM: the key, the Bernoulli masks, the state that stands for a model, the compact
artifact).
"""
