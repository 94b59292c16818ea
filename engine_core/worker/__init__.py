"""The model on its device: `Platform` (every machine- and device-dependent choice, settled once
at start-up), `ModelRunner` (loads the model, sizes and allocates the KV cache, runs one packed
forward per step), the GPU memory rule, torch's threads per step, and the built-in models.
Imports `layers/`, `sched/`, `sample/` and the root's `config` (a leaf)."""
