"""`python -m schedcomp.cli ...` runs the command line."""

import sys

from schedcomp.cli import main

sys.exit(main())
