"""What the ``validate_*.py`` scripts share: their command line and the loop that plans each
published row in a scratch folder.

Each script supplies its own ``validate(row, workdir) -> dict`` (the row's commands and its
errors) and its own printing; this module only selects the rows (``--only``) and runs them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Callable, Optional

__all__ = ["parse_args", "validate_rows"]


def parse_args(description: str, argv: Optional[list[str]] = None) -> argparse.Namespace:
    """``--only ID`` (repeatable) and ``--markdown``, the flags every validation script takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", action="append", help="a row id (repeatable)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parser.parse_args(argv)


def validate_rows(runs_path: Path, only: Optional[list[str]], validate: Callable[[dict, Path], dict],
                  on_row: Optional[Callable[[dict, dict], None]] = None) -> tuple[list[dict], list[dict]]:
    """Plan every row of ``runs_path`` (a ``{"runs": [...]}`` file) named by ``only`` (all when
    empty) with ``validate``, calling ``on_row(row, result)`` after each; return the rows and
    their results, in the file's order."""
    runs = json.loads(Path(runs_path).read_text())["runs"]
    rows = [r for r in runs if not only or r["id"] in only]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            result = validate(row, Path(tmp))
            results.append(result)
            if on_row is not None:
                on_row(row, result)
    return rows, results
