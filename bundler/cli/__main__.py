"""`python -m bundler.cli ...`: the `bundle` command with the build host's commands."""

import sys

from bundler.cli import main

sys.exit(main())
