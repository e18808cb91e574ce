"""Edge server: serves its devices the edge model, aggregates their updates, reports up."""

from edge_node.service import EdgeServer

__all__ = ["EdgeServer"]
