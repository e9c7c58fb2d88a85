"""`python -m mmserve`: the same as the `mmserve` command."""

from __future__ import annotations

from mmserve.cli import main

raise SystemExit(main())
