"""``python -m cloud``: run the cloud aggregator process."""

from cloud.main import main

raise SystemExit(main())
