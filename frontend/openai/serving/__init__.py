"""What the APIs share below them: the served model, the planner (`plan.py`) and chat's
(`chat_plan.py`, which chat and responses share), the choice run against the engine and its
JSON and SSE answers (`choices.py`, `sse.py`). Imports `protocol/`, `reasoning/` and `tools/`."""
