"""Maintainer probes, run from the repository root as `python -m tools.<name>` (index: README.md here)."""
