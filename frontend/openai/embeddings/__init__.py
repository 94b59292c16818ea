"""/v1/embeddings (`endpoint.py`) and its schemas (`protocol.py`). Imports `serving/` and
`protocol/`, no other API."""
