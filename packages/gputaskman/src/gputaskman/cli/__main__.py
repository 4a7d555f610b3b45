"""`python -m gputaskman.cli`: the same as the `gputaskman` command."""

import sys

from gputaskman.cli import main

sys.exit(main())
