"""`hsd models` commands (filled in by its issue)."""


def register(app):
    """Add this group's commands to the typer ``app``."""
