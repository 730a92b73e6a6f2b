"""`python -m app.cli`: the `voice-agent` command (as before the CLI became a package)."""

from app.cli.commands import main

raise SystemExit(main())
