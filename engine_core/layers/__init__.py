"""The model's layers as the engine runs them, below everything else in the engine.

Paged attention (portable torch, CUDA), the decoder's linear layers and fused elementwise work,
the LM head, the compiled CPU kernels under them (`native.py`, `csrc/`), and the two helpers
they share (`ChunkPool`, `HostLink`). Imports nothing else of the engine.
"""
