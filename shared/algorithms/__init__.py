"""Federated algorithms, one per file, each with its device-side and server-side parts
together, registered by name (:func:`~shared.algorithms.base.register`); the pure
aggregation maths they share live in :mod:`shared.algorithms.aggregation`.

Importing this package registers every built-in algorithm.
"""

from shared.algorithms import fedavg as _fedavg  # noqa: F401  (registers "fedavg")
from shared.algorithms import feddeo as _feddeo  # noqa: F401  (registers "feddeo")
from shared.algorithms import feddiffuse as _feddiffuse  # noqa: F401  (registers "feddiffuse")
from shared.algorithms import fedphd as _fedphd  # noqa: F401  (registers "fedphd")
from shared.algorithms import fedprox as _fedprox  # noqa: F401  (registers "fedprox")
from shared.algorithms import local as _local  # noqa: F401  (registers "local")
from shared.algorithms import moon as _moon  # noqa: F401  (registers "moon")
from shared.algorithms import pfedgpa as _pfedgpa  # noqa: F401  (registers "pfedgpa")
from shared.algorithms import prism as _prism  # noqa: F401  (registers "prism")
from shared.algorithms import scaffold as _scaffold  # noqa: F401  (registers "scaffold")
from shared.algorithms.base import (
    Accuracy,
    Algorithm,
    DeviceContext,
    Fold,
    LocalResult,
    Update,
    make_algorithm,
    register,
    registered,
)

__all__ = [
    "Accuracy",
    "Algorithm",
    "DeviceContext",
    "Fold",
    "LocalResult",
    "Update",
    "make_algorithm",
    "register",
    "registered",
]
