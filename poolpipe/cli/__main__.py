"""`python -m poolpipe.cli`: the same as the `poolpipe` command."""

import sys

from poolpipe.cli import main

sys.exit(main())
