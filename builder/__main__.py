"""`python -m builder`: the command line."""

from builder.cli import main

raise SystemExit(main())
