"""``python -m estuary`` runs the command line."""

from estuary.cli import main

raise SystemExit(main())
