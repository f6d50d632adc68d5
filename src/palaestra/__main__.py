"""``python -m palaestra`` runs the CLI."""

from palaestra.cli import main

raise SystemExit(main())
