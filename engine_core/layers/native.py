"""The CPU kernels of the LM head, the decoder's linears, its elementwise work and its decode
attention (csrc/kernels.c), compiled on first use and loaded with ctypes.

Compiled on the machine that runs them, with -march=native, into a cache folder under a name
that hashes the source, the compiler command and this CPU's feature flags, so a shared home
folder across different hosts keeps one build per kind of CPU. A compiler is part of any
machine that installs Python packages from source; where there is none (or the build fails),
the head keeps its portable torch path. Which compiler and which folder, and whether to try at
all (`TANDEM_NATIVE=0`), the platform settles at start-up (engine_core/worker/platform.py): nothing
here reads the environment. ctypes releases the GIL for the length of each call, so the head's
chunk threads run these kernels in parallel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "kernels.c"
# -ffast-math for the vectorised expf (glibc's libmvec) and reassociated reductions; compiled
# and linked in two steps, because linking with it adds crtfastmath.o, which sets flush-to-zero
# for the whole process at load time (a denormal then compares equal to 0 everywhere).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
PANEL = 16  # columns per packed weight panel (NR in the source)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Kernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.head_scan = lib.head_scan
        self.head_scan.argtypes = [_P, _I, _I, _I, _P, _I, _I, _P, _I, _I, _P, _I, _P, _P, _P, _P]
        self.head_scan.restype = None
        self.count_above = lib.count_above
        self.count_above.argtypes = [_P, _I, _P, _I, _P, _I, _I, _P]
        self.count_above.restype = None
        self.panel_matmul = lib.panel_matmul
        self.panel_matmul.argtypes = [_P, _I, _I, _I, _P, _I, _I, _P, _I]
        self.panel_matmul.restype = None
        # the decoder layer's fused elementwise work (fused.py)
        self.rms_norm = lib.rms_norm
        self.rms_norm.argtypes = [_P, _P, _P, _F, _I, _I, _P]
        self.rms_norm.restype = None
        self.silu_mul = lib.silu_mul
        self.silu_mul.argtypes = [_P, _I, _I, _P]
        self.silu_mul.restype = None
        self.rotary = lib.rotary
        self.rotary.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I]
        self.rotary.restype = None
        self.cache_write = lib.cache_write
        self.cache_write.argtypes = [_P, _I, _P, _I, _I, _I, _P, _I, _P, _P]
        self.cache_write.restype = ctypes.c_int64
        # decode rows' attention over the paged KV cache, read in place (attention.py)
        self.decode_attention = lib.decode_attention
        self.decode_attention.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _F,
                                          _P, _I, _P]
        self.decode_attention.restype = None
        # a prefill chunk's causal attention over a contiguous context (attention.py)
        self.prefill_attention = lib.prefill_attention
        self.prefill_attention.argtypes = [_P, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P,
                                           _I, _P]
        self.prefill_attention.restype = None


def pack_panels(weight_t: torch.Tensor) -> torch.Tensor:
    """[hidden, vocab] -> [panels, hidden, PANEL] float32, contiguous; the vocabulary padded
    with zero columns to a whole panel."""
    hidden, vocab = weight_t.shape
    padded = -(-vocab // PANEL) * PANEL
    w = torch.zeros(hidden, padded, dtype=torch.float32)
    w[:, :vocab] = weight_t
    return w.view(hidden, padded // PANEL, PANEL).transpose(0, 1).contiguous()


def ptr(t: torch.Tensor | None) -> int | None:
    """Address of `t`'s first element, None for None."""
    return None if t is None else t.data_ptr()


def find_compiler(cc: str | None = None) -> str | None:
    """`cc` (the CC variable, when set), else cc or gcc on PATH; None without one."""
    return cc or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load(compiler: str, cache_dir: Path) -> Kernels | None:
    """The kernels, built with `compiler` into `cache_dir` unless already there; None (with a
    warning) when the build or the load fails. Cached: one build and one load per process."""
    try:
        return Kernels(ctypes.CDLL(str(_build(compiler, cache_dir))))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable (%s); using torch ops", e)
        return None


def _build(cc: str, cache_dir: Path) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(FLAGS).encode(),
                                     _cpu_flags()])).hexdigest()[:16]
    out = cache_dir / "kernels" / f"kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    # Built beside the target, then renamed: processes starting together never load half a file.
    try:
        obj = tmp + ".o"
        subprocess.run([cc, *FLAGS, "-c", str(SOURCE), "-o", obj], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([cc, "-shared", obj, "-o", tmp, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise OSError(f"{cc} failed: {e.stderr.decode(errors='replace').strip()[-500:]}") from e
    finally:
        for leftover in (tmp, tmp + ".o"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    log.info("compiled the CPU kernels into %s", out)
    return out


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return os.uname().machine.encode()
