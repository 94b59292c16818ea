"""`tandem serve --enable-lora --lora-modules ...` through the real launcher, engine and
sockets: /v1/models lists each adapter with the base model as its parent; requests naming
the base model and two adapters, concurrently, get Hugging Face's greedy text and logprobs
with that adapter merged (tests/engine/test_lora.py builds the adapters); an unknown model is
a 404 in OpenAI's error shape; embeddings run with an adapter too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.e2e.server import Server
from tests.engine.test_hf_parity import MAX_NEW, make_prompts
from tests.engine.test_lora import adapters, merged  # noqa: F401 - the module's fixtures

pytestmark = pytest.mark.timeout(240)


async def test_adapters_listed_and_served_mixed(tiny_llama: Path, tmp_path: Path,
                                                adapters, merged) -> None:  # noqa: F811
    server = Server(tiny_llama, tmp_path, "--device", "cpu", "--dtype", "float32",
                    "--enable-lora", "--lora-modules", f"alpha={adapters['alpha']}",
                    f'{{"name": "beta", "path": "{adapters["beta"]}"}}', "--max-loras", "2",
                    "--max-lora-rank", "8", "--max-model-len", "512",
                    "--num-kv-blocks", "128").wait_healthy()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
        prompts = make_prompts(tokenizer, n=9)
        names = [None, "alpha", "beta"]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.url}/v1/models") as resp:
                cards = {c["id"]: c for c in (await resp.json())["data"]}
            assert set(cards) == {"m", "alpha", "beta"}
            assert cards["m"]["parent"] is None
            assert cards["alpha"]["parent"] == "m"
            assert cards["beta"]["root"] == str(adapters["beta"])

            async def complete(i: int) -> dict:
                body = {"model": names[i % 3] or "m", "prompt": prompts[i],
                        "max_tokens": MAX_NEW, "temperature": 0, "logprobs": 1}
                async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            answers = await asyncio.gather(*(complete(i) for i in range(len(prompts))))
            async with session.post(f"{server.url}/v1/completions",
                                    json={"model": "gamma", "prompt": "hi"}) as resp:
                assert resp.status == 404
                error = (await resp.json())["error"]
            async with session.post(f"{server.url}/v1/load_lora_adapter", json={
                    "lora_name": "g", "lora_path": str(adapters["gamma"])}) as resp:
                assert resp.status == 404  # VLLM_ALLOW_RUNTIME_LORA_UPDATING unset: no route
            async with session.post(f"{server.url}/v1/embeddings",
                                    json={"model": "alpha", "input": "hi"}) as resp:
                assert resp.status == 200
                assert (await resp.json())["model"] == "alpha"
        assert error["code"] == "model_not_found" and error["param"] == "model"
        for i, answer in enumerate(answers):
            lora = names[i % 3]
            tokens, lps = merged[lora].generate(prompts[i])
            assert answer["model"] == (lora or "m")
            choice = answer["choices"][0]
            assert choice["text"] == tokenizer.decode(tokens), (i, lora)
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=2e-4)
    finally:
        server.stop()


async def test_runtime_load_and_unload_across_two_frontends(
        tiny_llama: Path, tmp_path: Path, adapters, merged,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING=true with two frontends: an adapter loaded through
    one is served by both (the other asks the engine when it sees the new name); vLLM's
    status codes and messages; unloaded, it is a 404 again."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    server = Server(tiny_llama, tmp_path, "--device", "cpu", "--dtype", "float32",
                    "--enable-lora", "--lora-modules", f"alpha={adapters['alpha']}",
                    "--max-lora-rank", "8", "--max-model-len", "512", "--num-kv-blocks", "128",
                    "--api-server-count", "2").wait_healthy()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    prompt = make_prompts(tokenizer, n=3)[-1]
    want = tokenizer.decode(merged["beta"].generate(prompt)[0])
    load, unload = f"{server.url}/v1/load_lora_adapter", f"{server.url}/v1/unload_lora_adapter"
    try:
        async with aiohttp.ClientSession() as session:
            async def post(url: str, body: dict) -> tuple[int, str]:
                async with session.post(url, json=body) as resp:
                    return resp.status, await resp.text()

            beta = {"lora_name": "beta", "lora_path": str(adapters["beta"])}
            assert (await post(load, beta))[:2] == (
                200, "Success: LoRA adapter 'beta' added successfully.")
            status, text = await post(load, beta)
            assert status == 400 and "'beta' has already been loaded" in text
            status, text = await post(load, {"lora_name": "x", "lora_path": "/nowhere"})
            assert status == 404 and "No adapter found for /nowhere" in text
            status, text = await post(load, {"lora_name": "x"})
            assert status == 400 and "Both 'lora_name' and 'lora_path'" in text
            body = {"model": "beta", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            frontends = set()
            for _ in range(12):  # new connections: the port's two frontends share them
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.post(f"{server.url}/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        assert (await resp.json())["choices"][0]["text"] == want
                        frontends.add(resp.headers.get("X-Tandem-Frontend"))
            assert (await post(unload, {"lora_name": "beta"}))[:2] == (
                200, "Success: LoRA adapter 'beta' removed successfully.")
            status, text = await post(unload, {"lora_name": "beta"})
            assert status == 404 and "'beta' cannot be found" in text
            for _ in range(4):
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.get(f"{server.url}/v1/models") as resp:
                        ids = {c["id"] for c in (await resp.json())["data"]}
                assert ids == {"m", "alpha"}
        assert len(frontends) == 2  # (all 12 on one frontend: a 1-in-2048 chance)
    finally:
        server.stop()
