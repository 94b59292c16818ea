"""Quantized number formats the engine stores: the fp8 KV cache (fp8_kv.py). Below every other
package: the layers and the runner use it, it uses nothing of theirs."""
