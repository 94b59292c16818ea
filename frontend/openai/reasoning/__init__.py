"""Reasoning outputs (`--reasoning-parser`): a choice's text split into its thinking and its
answer (`outputs.py`), by vLLM's parsers (`parsers.py`). Imports `protocol/`."""
