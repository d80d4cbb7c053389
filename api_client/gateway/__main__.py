"""`python -m api_client.gateway`: the gateway process, as `ggufq up` starts it."""

import sys

from api_client.gateway.server import main

sys.exit(main())
