"""Writing a benchmark's report: every tool saves the same way."""

from __future__ import annotations

import json


def write_json(path: str | None, report: dict) -> None:
    """Save `report` as indented JSON at `path` (nothing when path is None)."""
    if path:
        with open(path, "w") as handle:
            json.dump(report, handle, indent=2)
