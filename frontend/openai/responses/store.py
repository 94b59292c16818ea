"""`--responses-store-size N`: the last N responses of this frontend process, kept in memory, so
that a request may continue one by `previous_response_id` instead of sending the whole history.

Each entry is the conversation up to and including that response, as chat messages: its input
(and the history it continued) and its output; the instructions are not kept, as OpenAI does
not carry them over. The store is bounded (the oldest entry goes first) and belongs to one
frontend process: behind several frontends (`--api-server-count` > 1 sharing a port, or
frontends on other hosts) a follow-up that reaches another process does not find the id, and
gets the same 400 as an id never seen. A restart forgets everything. Off by default (N = 0):
the server is stateless, and `previous_response_id` is a 400 asking for the whole history.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from frontend.openai.protocol.chat import ChatMessage


class ResponseStore:
    """A bounded, least-recently-used map of response ids to their conversations. Locked: a
    large request is planned on a worker thread (serving.prepare)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, list[ChatMessage]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, conversation: list[ChatMessage]) -> None:
        with self._lock:
            self._entries[response_id] = conversation
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> list[ChatMessage] | None:
        """The conversation a response ended, or None when this store does not hold it."""
        with self._lock:
            conversation = self._entries.get(response_id)
            if conversation is not None:
                self._entries.move_to_end(response_id)
            return conversation

    def __len__(self) -> int:
        return len(self._entries)
