"""`python -m poolpipe_cli`: the same as the `poolpipe` command."""

import sys

from poolpipe_cli import main

sys.exit(main())
