"""``python -m r2med_agent`` is the ``r2med-agent`` command."""

import sys

from r2med_agent.cli import main

sys.exit(main())
