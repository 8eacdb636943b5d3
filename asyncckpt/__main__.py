"""``python -m asyncckpt`` runs the command-line tool."""

import sys

from asyncckpt.cli import main

sys.exit(main())
