"""The ``estuary`` command line: the one composition root that may import every role."""
