"""`python -m duvm.cli`: how duvm starts its own helper processes (the daemon, the supervisor)."""

import sys

from duvm.cli import main

sys.exit(main())
