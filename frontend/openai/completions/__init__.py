"""POST /v1/completions (`endpoint.py`). Imports `serving/` and `protocol/`, no other API."""
