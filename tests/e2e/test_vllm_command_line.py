"""A production-stack-style `vllm serve` command line starts Tandem and serves: vLLM's flag
names (underscores included), its no-op flags, a --config YAML file, CORS and /ping."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.server import Server

VLLM_FLAGS = [
    "--max_model_len", "1024", "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1",
    "--enable-chunked-prefill", "--enforce-eager", "--disable-log-stats",
    "--disable-log-requests", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    "--max-logprobs", "20", "--response-role", "assistant", "--generation-config", "vllm",
    "--allowed-origins", '["https://app.example"]',
]


def call(url: str, method: str = "GET", body: dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json",
                                                 **(headers or {})}, method=method)
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.status), dict(response.headers), response.read()


@pytest.mark.timeout(180)
def test_a_vllm_command_line_serves(tiny_llama: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 32\nkv_cache_memory_bytes: 268435456\n"
                      "enable_prefix_caching: true\nblock_size: 16\n")
    server = Server(tiny_llama, tmp_path, *VLLM_FLAGS, "--config", str(config)).wait_healthy()
    try:
        status, _, body = call(f"{server.url}/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 1024
        chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        status, headers, body = call(f"{server.url}/v1/chat/completions", "POST", chat,
                                     {"Origin": "https://app.example"})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["role"] == "assistant"
        assert headers["Access-Control-Allow-Origin"] == "https://app.example"
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = call(f"{server.url}/v1/completions", "OPTIONS", headers=preflight)
        assert status == 200 and "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        _, headers, _ = call(f"{server.url}/health", headers={"Origin": "https://other.example"})
        assert "Access-Control-Allow-Origin" not in headers
        assert call(f"{server.url}/ping")[0] == 200
        assert call(f"{server.url}/ping", "POST", {})[0] == 200
        assert call(f"{server.url}/reset_prefix_cache", "POST", {})[0] == 200
    finally:
        assert server.stop() == 0


def test_a_flag_that_cannot_be_served_is_a_clear_start_up_error(tiny_llama: Path,
                                                                tmp_path: Path) -> None:
    server = Server(tiny_llama, tmp_path, "--tensor_parallel_size", "0")
    assert server.proc.wait(timeout=60) == 2


TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<bot>>{% endif %}")


@pytest.mark.timeout(180)
def test_chat_template_response_role_and_https(tiny_llama: Path, tmp_path: Path) -> None:
    """--chat-template (a file), --response-role and --ssl-keyfile/--ssl-certfile."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)],
                   check=True, capture_output=True)
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    server = Server(tiny_llama, tmp_path, "--chat-template", str(template), "--response-role",
                    "bot", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    server.wait_healthy()
    https = server.url.replace("http://", "https://")
    context = ssl.create_default_context(cafile=str(cert))
    try:
        messages = [{"role": "user", "content": "Hi"}]
        request = urllib.request.Request(
            f"{https}/tokenize", json.dumps({"messages": messages}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60, context=context) as response:
            tokens = json.loads(response.read())["tokens"]
        tokenize = urllib.request.Request(
            f"{https}/tokenize", json.dumps({"prompt": "<<user>>Hi\n<<bot>>",
                                             "add_special_tokens": False}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(tokenize, timeout=60, context=context) as response:
            assert tokens == json.loads(response.read())["tokens"]  # the given template
        chat = urllib.request.Request(
            f"{https}/v1/chat/completions",
            json.dumps({"model": "m", "messages": messages, "max_tokens": 3}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(chat, timeout=60, context=context) as response:
            assert json.loads(response.read())["choices"][0]["message"]["role"] == "bot"
    finally:
        assert server.stop() == 0
