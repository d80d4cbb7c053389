"""``python -m api_client.cli``: the ``ggufq`` command."""

import sys

from api_client.cli import main

sys.exit(main())
