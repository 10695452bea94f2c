"""`python -m multihost.launch`: runs the launcher's command line (see `multihost.launch`)."""

from __future__ import annotations

import sys

from multihost.launch._src.run import cli as _cli

if __name__ == '__main__':
  sys.exit(_cli.main())
