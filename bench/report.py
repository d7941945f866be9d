"""What every bench does with its result: print it as JSON, and keep it under bench/results/ when asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, path: str | Path | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
