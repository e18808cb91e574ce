"""``python -m device_agent``: run one device agent process."""

from device_agent.main import main

raise SystemExit(main())
