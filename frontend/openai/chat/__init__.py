"""POST /v1/chat/completions (`endpoint.py`). Imports the packages below it, no other API."""
