"""The schemas the APIs share: the sampling fields, usage and the model list (`base.py`), chat's
messages, answers and chunks (`chat.py`: the Responses API and /tokenize speak its messages
too), structured outputs (`structured.py`). Imports nothing else of `frontend.openai`."""
