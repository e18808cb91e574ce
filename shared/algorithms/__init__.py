"""Federated algorithms, one per file, registered by name.

Importing this package registers every built-in algorithm.
"""

from shared.algorithms import fedavg as _fedavg  # noqa: F401  (registers "fedavg")
from shared.algorithms import fedphd as _fedphd  # noqa: F401  (registers "fedphd")
from shared.algorithms.base import (
    Algorithm,
    DeviceContext,
    LocalResult,
    Update,
    make_algorithm,
    register,
    registered,
)

__all__ = [
    "Algorithm",
    "DeviceContext",
    "LocalResult",
    "Update",
    "make_algorithm",
    "register",
    "registered",
]
