"""Container healthcheck: exit 0 when this role's Prometheus ``/metrics`` endpoint answers.

The port is ``$ESTUARY__METRICS__PORT`` (9100 in the images). Standard library only, so it
runs in every image that has python3.
"""

import os
import sys
import urllib.request

port = os.environ.get("ESTUARY__METRICS__PORT", "9100")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=4) as reply:
        sys.exit(0 if reply.status == 200 else 1)
except OSError as err:
    print(f"/metrics on port {port}: {err}", file=sys.stderr)
    sys.exit(1)
