"""`python -m draftforge ...` (and `accelerate launch -m draftforge train ...`)."""

import sys

from draftforge.cli import main

sys.exit(main())
