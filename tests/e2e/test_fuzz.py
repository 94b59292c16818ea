"""Bad input at scale: over a thousand malformed bodies thrown at /v1/completions and
/v1/chat/completions of one `tandem serve`, sixteen at a time.

Every body is invalid by construction. Per endpoint: 400 valid base bodies with one field
corrupted (a value of the wrong JSON type, out of range, or breaking a cross-field rule; or a
required field dropped), 100 with up to three, then broken JSON bytes, invalid UTF-8 and
non-object JSON. An explicit JSON null means "the default" in this API, so no corruption is
ever a bare null. Each answer must be a 4xx in OpenAI's error shape, never a 5xx or a hang;
afterwards the server still serves.

The bodies come from hypothesis strategies, drawn once up front with a fixed seed, so every run
sends the same bodies.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.e2e.server import Server

T = TypeVar("T")

MAX_MODEL_LEN = 512
VOCAB = 128256  # the tiny Llama's vocabulary (Llama 3 tokenizer)
ROLES = ("system", "user", "assistant", "tool", "developer")
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
INT64_MAX = 2**63 - 1
DROP = object()  # a patch value meaning "remove the field"

COMPLETION = {"model": "m", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 2,
    "temperature": 0,
}

# ---- JSON values of a chosen kind -------------------------------------------------------

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
HUGE_INTS = st.sampled_from([2**64, -(2**64), 10**30, -(10**40), 2**200])
KINDS: dict[str, st.SearchStrategy[Any]] = {
    "bool": st.booleans(),
    "int": st.integers() | HUGE_INTS,
    "float": st.floats(allow_nan=False, allow_infinity=False),
    "str": st.text(max_size=8),
    "list": st.lists(JUNK, max_size=3),
    "dict": st.dictionaries(st.text(max_size=4), JUNK, max_size=3),
}


def wrong_type(*accepted: str) -> st.SearchStrategy[Any]:
    """A non-null JSON value of none of the `accepted` kinds (an int is a valid float).

    One strategy, not a `one_of` (which hypothesis would flatten into its neighbours): a field's
    wrong types together weigh as much as each of its out-of-range or rule-breaking branches."""
    if "float" in accepted:
        accepted = (*accepted, "int")
    kinds = [kind for kind in KINDS if kind not in accepted]
    return st.sampled_from(kinds).flatmap(KINDS.__getitem__)


def below(bound: float, inclusive: bool = False) -> st.SearchStrategy[float]:
    return st.floats(max_value=bound, exclude_max=not inclusive, allow_nan=False,
                     allow_infinity=False)


def above(bound: float, inclusive: bool = False) -> st.SearchStrategy[float]:
    return st.floats(min_value=bound, exclude_min=not inclusive, allow_nan=False,
                     allow_infinity=False)


def int_outside(lo: int | None, hi: int | None) -> st.SearchStrategy[int]:
    parts = []
    if lo is not None:
        parts.append(st.integers(max_value=lo - 1))
    if hi is not None:
        parts.append(st.integers(min_value=hi + 1) | st.just(10**30))
    return st.one_of(*parts)


OUT_OF_VOCAB = st.integers(max_value=-1) | st.integers(min_value=VOCAB) | HUGE_INTS
NOT_AN_ID = st.from_regex(r"[a-zA-Z.+\-x]{0,5}[a-zA-Z.]", fullmatch=True)  # int() refuses it


def with_one(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy:
    """A list of `good` items with one `bad` item somewhere in it."""
    return st.tuples(st.lists(good, max_size=3), bad, st.integers(0, 3)).map(
        lambda t: t[0][: t[2]] + [t[1]] + t[0][t[2]:]
    )


# ---- corruptions of the fields both APIs share -------------------------------------------

def sampling_corruptions() -> dict[str, st.SearchStrategy[Any]]:
    bools = {
        name: wrong_type("bool")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "stream")
    }
    return {
        **bools,
        "model": wrong_type("str") | st.text(max_size=8).filter(lambda s: s != "m"),
        "n": wrong_type("int") | int_outside(1, 128),
        "seed": wrong_type("int") | int_outside(-(2**63), INT64_MAX),
        "temperature": wrong_type("float") | below(-1e-300, inclusive=True),
        "top_p": wrong_type("float") | below(0.0, inclusive=True) | above(1.0),
        "top_k": wrong_type("int") | int_outside(-1, INT64_MAX),
        "min_p": wrong_type("float") | below(-1e-300, inclusive=True) | above(1.0),
        "presence_penalty": wrong_type("float") | below(-2.0) | above(2.0),
        "frequency_penalty": wrong_type("float") | below(-2.0) | above(2.0),
        "repetition_penalty": wrong_type("float") | below(0.0, inclusive=True),
        "logit_bias": wrong_type("dict") | st.one_of(
            with_one(st.just(("1", 1.0)), st.tuples(NOT_AN_ID, st.floats(-5, 5))),
            with_one(st.just(("1", 1.0)), st.tuples(OUT_OF_VOCAB.map(str), st.floats(-5, 5))),
            with_one(st.just(("1", 1.0)), st.tuples(st.just("2"), wrong_type("float") | st.none())),
        ).map(dict),
        "stop": wrong_type("str", "list") | st.sampled_from(["", [""], ["a", ""]])
        | with_one(st.text(min_size=1, max_size=3), wrong_type("str") | st.none())
        | st.lists(st.text(min_size=1, max_size=3), min_size=65, max_size=70),
        "stop_token_ids": wrong_type("list")
        | with_one(st.integers(0, VOCAB - 1), wrong_type("int") | st.none() | OUT_OF_VOCAB),
        # max_tokens is 2 in both base bodies
        "min_tokens": wrong_type("int") | st.integers(max_value=-1) | st.integers(min_value=3),
        "stream_options": wrong_type("dict")
        # well formed, but stream is not true
        | st.fixed_dictionaries({}, optional={k: st.booleans() for k in STREAM_OPTIONS})
        | st.dictionaries(st.text(max_size=6).filter(lambda k: k not in STREAM_OPTIONS), JUNK,
                          min_size=1, max_size=2)
        | st.fixed_dictionaries({"include_usage": wrong_type("bool")}),
        "user": wrong_type("str"),
    }


def completion_corruptions() -> dict[str, st.SearchStrategy[Any]]:
    ids = st.integers(0, VOCAB - 1)
    too_long = st.sampled_from(["hi " * 600, [[5] * 600], [7] * 520])
    return {
        **sampling_corruptions(),
        "prompt": st.just(DROP) | wrong_type("str", "list") | too_long | st.sampled_from([
            [], [[]], ["a", 1], [1, "a"], [[1], "a"], [1, [2]], [[1, 2], []], [True], [None],
            [{"a": 1}], [[1.5]], [1.0], [[True]],
        ]) | with_one(ids, OUT_OF_VOCAB) | with_one(ids, OUT_OF_VOCAB).map(lambda p: [[1], p]),
        "echo": wrong_type("bool"),
        "logprobs": wrong_type("int") | int_outside(0, 20),
        # 0 needs echo=true; the prompt is 2 tokens, so 511 overflows the 512-token context
        "max_tokens": wrong_type("int") | st.integers(max_value=0) | st.integers(min_value=511),
        "best_of": wrong_type("int") | st.integers(max_value=0) | st.integers(min_value=2),
        "n+best_of": st.tuples(st.integers(1, 4), st.integers(1, 6)).filter(
            lambda t: t[0] != t[1]).map(lambda t: {"n": t[0], "best_of": t[1]}),
        "suffix": st.text(max_size=5) | wrong_type("str"),
        "min_tokens+no max_tokens": st.integers(min_value=MAX_MODEL_LEN)
        .map(lambda k: {"min_tokens": k, "max_tokens": DROP}),
        "return_tokens_as_token_ids": wrong_type("bool"),
    }


# ---- chat messages ------------------------------------------------------------------------

GOOD_MESSAGE = st.sampled_from([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
])
GOOD_PART = st.just({"type": "text", "text": "Hi"})
BAD_PART = st.one_of(
    wrong_type("dict"),
    st.fixed_dictionaries({"type": st.text(max_size=10).filter(lambda t: t != "text"),
                           "text": st.text(max_size=4)}),
    st.sampled_from([{"type": "text"}, {"text": "a"}, {"type": "image_url",
                     "image_url": {"url": "data:,"}}]),
    st.fixed_dictionaries({"type": st.just("text"), "text": wrong_type("str")}),
    st.fixed_dictionaries({"type": wrong_type("str"), "text": st.just("a")}),
)


def with_field(name: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[dict]:
    return value.map(lambda v: {"role": "user", "content": "Hi", name: v})


BAD_MESSAGE = st.one_of(
    wrong_type("dict"),
    st.sampled_from([{"content": "Hi"}, {"role": "user"}, {"role": "user", "content": None},
                     {"role": "assistant"}, {}]),
    st.text(max_size=10).filter(lambda r: r not in ROLES).map(
        lambda r: {"role": r, "content": "Hi"}),
    wrong_type("str").map(lambda r: {"role": r, "content": "Hi"}),
    wrong_type("str", "list").map(lambda c: {"role": "user", "content": c}),
    with_one(GOOD_PART, BAD_PART).map(lambda parts: {"role": "user", "content": parts}),
    with_field("name", wrong_type("str")),
    with_field("tool_call_id", wrong_type("str")),
    with_field("tool_calls", wrong_type("list") | with_one(st.just({"id": "1"}),
                                                           wrong_type("dict"))),
)


def chat_corruptions() -> dict[str, st.SearchStrategy[Any]]:
    length = wrong_type("int") | st.integers(max_value=0) | st.integers(min_value=MAX_MODEL_LEN)
    return {
        **sampling_corruptions(),
        "messages": st.just(DROP) | wrong_type("list") | st.just([])
        | with_one(GOOD_MESSAGE, BAD_MESSAGE),
        "max_tokens": length,
        "max_completion_tokens": length,
        "logprobs": wrong_type("bool"),
        "top_logprobs": wrong_type("int") | st.integers(0, 20),  # without logprobs=true
        "logprobs+top_logprobs": (wrong_type("int") | int_outside(0, 20)).map(
            lambda k: {"logprobs": True, "top_logprobs": k}),
        "add_generation_prompt": wrong_type("bool"),
        "tools": wrong_type("list") | with_one(st.just({"type": "function"}), wrong_type("dict")),
        "min_tokens+no max_tokens": st.integers(min_value=MAX_MODEL_LEN)
        .map(lambda k: {"min_tokens": k, "max_tokens": DROP}),
    }


def corrupted(
    base: dict[str, Any], corruptions: dict[str, st.SearchStrategy[Any]], faults: int
) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with up to `faults` corruptions applied. A corruption whose fields another one
    already touched is skipped, so that each one applied keeps the value that makes it bad."""
    names = sorted(corruptions)
    chosen = st.lists(st.sampled_from(names), min_size=faults, max_size=faults, unique=True)
    patches = chosen.flatmap(lambda ns: st.tuples(*(patch(n, corruptions[n]) for n in ns)))

    def apply(drawn: tuple[dict[str, Any], ...]) -> dict[str, Any]:
        body, touched = dict(base), set[str]()
        for fields in drawn:
            if touched & fields.keys():
                continue
            touched |= fields.keys()
            for key, value in fields.items():
                if value is DROP:
                    body.pop(key, None)
                else:
                    body[key] = value
        return body

    return patches.map(apply)


def patch(name: str, values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The fields a corruption sets: a "a+b" corruption draws them all, others one value."""
    return values if "+" in name else values.map(lambda value: {name: value})


def broken_bytes(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Bytes that are no JSON object: truncated, trailing junk, invalid UTF-8, NaN, garbage."""
    raw = json.dumps(base).encode()
    invalid_utf8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf",
                                    b"\xf8\x88\x80\x80\x80", b"\x80abc", b"\xf4\x90\x80\x80"])
    return st.one_of(
        st.integers(0, len(raw) - 1).map(lambda k: raw[:k]),
        st.binary(min_size=1, max_size=8).map(lambda junk: raw + b"}" + junk),
        invalid_utf8.map(lambda bad: raw.replace(b'"m"', b'"m' + bad + b'"', 1)),
        invalid_utf8.map(lambda bad: raw.replace(b'"model"', b'"mod' + bad + b'el"', 1)),
        st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]).map(
            lambda lit: raw.replace(b'"temperature": 0', b'"temperature": ' + lit)),
        st.binary(max_size=40).map(lambda junk: b"\xff" + junk),
        st.sampled_from([b"", b"{", b"}", b"{'model': 'm'}", b'{"prompt": "a",}', b"\x00",
                         b'{"prompt": "\\ud800"}', b'{"a":1 "b":2}', b"\xef\xbb\xbf{}"]),
    )


NON_OBJECT = JUNK.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode())


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


def draw(strategy: st.SearchStrategy[T], count: int) -> list[T]:
    """`count` examples of `strategy`, the same on every run."""
    drawn: list[T] = []

    @seed(20260101)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value: T) -> None:
        drawn.append(value)

    collect()
    return drawn


def malformed_requests() -> list[tuple[str, bytes]]:
    cases: list[tuple[str, bytes]] = []
    for path, base, corruptions, structured in (
        ("/v1/completions", COMPLETION, completion_corruptions(), "prompt"),
        ("/v1/chat/completions", CHAT, chat_corruptions(), "messages"),
    ):
        # The server names only the first fault it meets: single faults test each rule, and
        # the structured field (prompt or messages, with many ways to be wrong) gets its own.
        bodies = draw(corrupted(base, corruptions, faults=1), 300)
        bodies += draw(corrupted(base, {structured: corruptions[structured]}, faults=1), 100)
        bodies += draw(corrupted(base, corruptions, faults=3), 100)
        raw = [encoded(b) for b in bodies] + draw(broken_bytes(base), 70) + draw(NON_OBJECT, 30)
        cases += [(path, body) for body in raw]
    return cases


# ---- the test -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tiny_llama, tmp_path_factory.mktemp("fuzz"), "--max-model-len",
                 str(MAX_MODEL_LEN))
    yield srv.wait_healthy()
    assert srv.stop() == 0


def error_shape_problem(status: int, content_type: str, raw: bytes) -> str | None:
    """What is wrong with an answer that should be a 4xx in OpenAI's error shape, if anything."""
    if not 400 <= status < 500:
        return f"status {status}"
    if content_type != "application/json":
        return f"content type {content_type}"
    try:
        body = json.loads(raw)
    except ValueError:
        return "body is not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return "not {'error': {message, type, param, code}}"
    if not isinstance(error["message"], str) or not error["message"].strip():
        return "empty message"
    if not isinstance(error["type"], str) or not error["type"]:
        return "empty type"
    return None


async def send_all(url: str, cases: list[tuple[str, bytes]]) -> list[str]:
    """Send every case, 16 at a time; return a line per bad answer."""
    gate = asyncio.Semaphore(16)
    timeout = aiohttp.ClientTimeout(total=30)

    async def one(session: aiohttp.ClientSession, path: str, body: bytes) -> str | None:
        async with gate:
            try:
                async with session.post(url + path, data=body, headers={
                        "Content-Type": "application/json"}) as resp:
                    raw = await resp.read()
                    problem = error_shape_problem(resp.status, resp.content_type, raw)
            except (TimeoutError, aiohttp.ClientError) as exc:
                problem, raw = f"no answer: {exc!r}", b""
        return None if problem is None else f"{problem}: {path} {body[:160]!r} -> {raw[:200]!r}"

    async with aiohttp.ClientSession(timeout=timeout) as session:
        answers = await asyncio.gather(*(one(session, p, b) for p, b in cases))
    return [a for a in answers if a is not None]


async def test_malformed_bodies_get_openai_4xx_and_the_server_survives(server: Server) -> None:
    cases = malformed_requests()
    assert len(cases) >= 1000
    assert {path for path, _ in cases} == {"/v1/completions", "/v1/chat/completions"}

    problems = await send_all(server.url, cases)
    assert not problems, f"{len(problems)} of {len(cases)} bad answers:\n" + "\n".join(
        problems[:15])

    assert server.proc.poll() is None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(f"{server.url}/health") as resp:
            assert resp.status == 200
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            async with session.post(server.url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
            assert answer["choices"][0]["finish_reason"] in ("length", "stop")
            assert answer["usage"]["completion_tokens"] >= 1
