"""Which adapters hold the device's `--max-loras` slots, and which sit in host memory.

A request that names an adapter runs only while its adapter holds a slot. When the scheduler
would start it (`admit`), its adapter is in a slot already, or takes the least recently used
slot that no running request's adapter holds, or the request waits (it is never refused for
want of a slot; the scheduler tries the requests behind it). An adapter's matrices are read
from its folder once and kept in host memory for the `--max-cpu-loras` most recently used
adapters (as vLLM's LRU caches); one pushed out is read again when next needed.

Adapters come and go at run time (`add`, `remove`: vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter). Each name gets a stable id, 1, 2, ... in the order the server first
knew it (vLLM's `lora_int_id`, the `lora_id` of its KV-cache events). A removed adapter takes
no new request at once; the requests already in the engine that use it finish with it, and
its slot and host copy are freed when the last of them is gone (`retire`).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch

from engine_core.lora.adapters import LoRAAdapter, LoRAError, read_adapter
from engine_core.lora.slots import LoRASlots
from shared.engine_args import LoRAModule

log = logging.getLogger(__name__)
NO_ADAPTER = -1


class LoRANotFoundError(LoRAError):
    """A name the engine does not serve, or a folder that holds no adapter (vLLM's 404s)."""


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
        self.ids: dict[str, int] = {}  # each name's lora_int_id, kept when it is removed
        self.retiring: dict[str, LoRAModule] = {}  # removed, still used by requests
        for module in self.modules.values():  # a broken adapter fails at start-up
            self._read(module.name)
            self.ids[module.name] = len(self.ids) + 1

    def knows(self, name: str) -> bool:
        """Whether a new request may name it (a removed adapter is not known)."""
        return name in self.modules

    def id_of(self, name: str | None) -> int | None:
        """An adapter's stable id (vLLM's lora_int_id); None for the base model."""
        return self.ids.get(name) if name else None

    def add(self, module: LoRAModule) -> bool:
        """Serve a new adapter, read and checked now; True when its name was served before
        (its old blocks in the prefix cache must then go: their chains start from the same
        root). Raises LoRANotFoundError (no adapter in the folder) or LoRAError (a name in
        use, or an adapter this engine cannot serve)."""
        if module.name in self.modules:
            raise LoRAError(f"The lora adapter '{module.name}' has already been loaded.")
        if module.name in self.retiring:
            raise LoRAError(f"The lora adapter '{module.name}' is being unloaded: its last "
                            "requests are still running; load it again when they finished.")
        if not Path(module.path).is_dir():
            raise LoRANotFoundError(f"Loading lora {module.name} failed: No adapter found "
                                    f"for {module.path}")
        adapter = read_adapter(module, self.max_rank, self.num_layers, self.dtype)
        self.modules[module.name] = module
        self.host[module.name] = adapter
        self._trim_host()
        log.info("LoRA adapter %r loaded from %s", module.name, module.path)
        if module.name in self.ids:  # served again: it keeps its id
            return True
        self.ids[module.name] = len(self.ids) + 1
        return False

    def remove(self, name: str, in_use: Iterable[str | None]) -> None:
        """Stop serving `name` to new requests; `in_use`: the adapters of the requests in the
        engine, which finish with it. Raises LoRANotFoundError for a name not served."""
        module = self.modules.pop(name, None)
        if module is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        self.retiring[name] = module
        self.retire(in_use)
        log.info("LoRA adapter %r unloaded", name)

    def retire(self, in_use: Iterable[str | None]) -> None:
        """Free the slot and host copy of each removed adapter no request uses any more."""
        used = set(in_use)
        for name in [n for n in self.retiring if n not in used]:
            del self.retiring[name]
            self.host.pop(name, None)
            slot = self.slot_of(name)
            if slot is not None:
                self.holder[slot] = None
                self.last_used[slot] = 0

    def served(self) -> list[LoRAModule]:
        """The adapters new requests may name, in the order they were loaded."""
        return list(self.modules.values())

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
            module = self.modules.get(name) or self.retiring[name]
            adapter = read_adapter(module, self.max_rank, self.num_layers, self.dtype)
            self.host[name] = adapter
            self._trim_host()
        self.host.move_to_end(name)
        return adapter

    def _trim_host(self) -> None:
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
