"""Frontends are what users scale out: each one stays light. It imports neither torch nor
transformers (nor numpy), and one serving the default model holds at most 150 MB of resident
memory (MiB, as /proc counts it), its token-string cache included."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.server import Server
from tests.e2e.test_launcher import children_of

MAX_FRONTEND_RSS_MB = 150


def test_the_frontend_modules_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import frontend.server, frontend.cli, frontend.openai.chat.endpoint\n"
        "import frontend.text.tokenizer, frontend.text.tokenizer_loader\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def post(url: str, body: dict) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
        return int(response.status)


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def frontend_pid(launcher: int) -> int:
    for pid in children_of(launcher):
        if b"frontend.server" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("no frontend process under the launcher")


def with_pair_merges(model: Path, folder: Path) -> Path:
    """`model` with its tokenizer.json saved as transformers 5 saves it: merges as pairs,
    indented (17 MB for Llama 3's vocabulary, against 6.6 MB with merges as strings)."""
    folder.mkdir()
    for item in model.iterdir():
        if item.name != "tokenizer.json":
            (folder / item.name).symlink_to(item)
    spec = json.loads((model / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    (folder / "tokenizer.json").write_text(json.dumps(spec, indent=2, ensure_ascii=False))
    return folder


@pytest.mark.timeout(180)
@pytest.mark.parametrize("merges", ["strings", "pairs"])
def test_a_serving_frontend_stays_small_and_torch_free(
    tiny_llama: Path, tmp_path: Path, merges: str
) -> None:
    """Loading a tokenizer.json with merges as pairs peaks ~100 MB above what it keeps: the
    frontend gives that back (frontend/memory.py)."""
    model = tiny_llama if merges == "strings" else with_pair_merges(tiny_llama, tmp_path / "m")
    server = Server(model, tmp_path).wait_healthy()
    try:
        for _ in range(3):  # every API once, so each code path is loaded
            body = {"model": "m", "prompt": "Hello there", "max_tokens": 8, "echo": True,
                    "logprobs": 2, "stream": True}
            assert post(f"{server.url}/v1/completions", body) == 200
            chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 8, "logprobs": True, "top_logprobs": 2}
            assert post(f"{server.url}/v1/chat/completions", chat) == 200
            assert post(f"{server.url}/tokenize", {"prompt": "Hi"}) == 200
        pid = frontend_pid(server.proc.pid)
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps
        assert rss_mb(pid) <= MAX_FRONTEND_RSS_MB, f"frontend holds {rss_mb(pid):.0f} MB"
    finally:
        assert server.stop() == 0
