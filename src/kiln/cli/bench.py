"""`kiln bench`: what does a baked cache buy? (filled in by the GPU issue)"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
