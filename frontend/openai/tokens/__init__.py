"""/tokenize, /detokenize and /tokenizer_info (`endpoint.py`) and their schemas
(`protocol.py`). Imports `serving/` and `protocol/`, no other API."""
