"""Which adapters hold the device's `--max-loras` slots, and which sit in host memory.

A request that names an adapter runs only while its adapter holds a slot. When the scheduler
would start it (`admit`), its adapter is in a slot already, or takes the least recently used
slot that no running request's adapter holds, or the request waits (it is never refused for
want of a slot; the scheduler tries the requests behind it). An adapter's matrices are read
from its folder once and kept in host memory for the `--max-cpu-loras` most recently used
adapters (as vLLM's LRU caches); one pushed out is read again when next needed.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch

from engine_core.lora.adapters import LoRAAdapter, read_adapter
from engine_core.lora.slots import LoRASlots
from shared.lora import LoRAModule

log = logging.getLogger(__name__)
NO_ADAPTER = -1


class LoRAManager:
    def __init__(self, modules: Iterable[LoRAModule], slots: LoRASlots, max_rank: int,
                 max_cpu_loras: int, num_layers: int, dtype: torch.dtype) -> None:
        self.modules = {m.name: m for m in modules}
        self.slots = slots
        self.max_rank, self.num_layers, self.dtype = max_rank, num_layers, dtype
        self.max_cpu_loras = max(max_cpu_loras, slots.num_slots)
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # most recent last
        self.holder: list[str | None] = [None] * slots.num_slots  # each slot's adapter
        self.last_used = [0] * slots.num_slots
        self._clock = itertools.count(1)
        self.loads = 0  # adapters put in a slot (tests, logs)
        for module in self.modules.values():  # a broken adapter fails at start-up
            self._read(module.name)

    def knows(self, name: str) -> bool:
        return name in self.modules

    def slot_of(self, name: str) -> int | None:
        return self.holder.index(name) if name in self.holder else None

    def admit(self, name: str | None, held: Iterable[int]) -> int | None:
        """The slot a request of adapter `name` (None: the base model) runs in, loading the
        adapter into one if it holds none; None when every slot is `held` by running
        requests' adapters (the request waits)."""
        if not name:
            return NO_ADAPTER
        slot = self.slot_of(name)
        if slot is None:
            busy = set(held)
            free = [s for s in range(self.slots.num_slots) if s not in busy]
            if not free:
                return None
            slot = min(free, key=lambda s: self.last_used[s])
            self.slots.load(slot, self._read(name))
            log.info("LoRA adapter %r into slot %d (was %s)", name, slot,
                     self.holder[slot] or "empty")
            self.holder[slot] = name
            self.loads += 1
        self.last_used[slot] = next(self._clock)
        return slot

    def _read(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:
            adapter = read_adapter(self.modules[name], self.max_rank, self.num_layers, self.dtype)
            self.host[name] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(name)
        return adapter
