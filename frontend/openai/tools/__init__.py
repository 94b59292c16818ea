"""Tool calling: the request's tools checked into a plan and a choice's text read into OpenAI's
calls (`calls.py`), by the extractors that read it piece by piece (`parsers.py`). Imports
`protocol/`."""
