"""`python -m distribuuuu ...` is the same as the `distribuuuu` command."""

import sys

from distribuuuu.cli import main

sys.exit(main())
