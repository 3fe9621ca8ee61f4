"""`python -m raypd.cli ...` is `raypd ...`."""

import sys

from raypd.cli import main

sys.exit(main())
