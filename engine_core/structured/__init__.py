"""Structured outputs in the engine (xgrammar, imported on first use): grammars compiled off the
step loop, one matcher per constrained request (grammar.py), and a step's token bitmask
(masks.py). Imports nothing else of the engine."""
