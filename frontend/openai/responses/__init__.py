"""POST /v1/responses: the endpoint, its schemas, input items as chat messages, output items
from a choice's deltas, and the store of conversations. Imports the packages below it (chat's
planner is `serving/chat_plan.py`), no other API."""
