"""Cloud aggregator: runs rounds, aggregates edge models, checkpoints the global model."""

from cloud.service import CloudServer, RoundSummary

__all__ = ["CloudServer", "RoundSummary"]
