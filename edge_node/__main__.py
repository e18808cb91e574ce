"""``python -m edge_node``: run one edge aggregator process."""

from edge_node.main import main

raise SystemExit(main())
