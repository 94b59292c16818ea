"""The OpenAI APIs, a package each, over what they share; imports point down only
(tests/unit/frontend/test_layout.py checks it):

- the APIs, siblings that never import each other: `completions/`, `chat/`, `responses/`
  (chat's machinery with other shapes around it), `tokens/` (/tokenize, /detokenize);
- `serving/`: what they share below them (the served model, the planners, the choice run and
  its JSON and SSE answers);
- `reasoning/` and `tools/`: what chat-shaped answers read from a choice's text;
- `protocol/`: the schemas they share (the sampling fields, chat's messages, structured outputs).
"""
