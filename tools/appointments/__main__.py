"""`python -m tools.appointments`: serve the stand-in clinic API."""

import sys

from tools.appointments.api import main

sys.exit(main())
