"""--runner / --convert / --pooler-config: vLLM's flags and JSON, checked without torch; and
where the engine reads a chunk's positions for each pooling."""

from __future__ import annotations

import argparse

import pytest

from engine_core.sample.pooling import pool_positions
from shared.engine_args import (
    PoolerConfigError,
    add_engine_args,
    check_engine_args,
    check_runner,
    engine_argv,
    parse_pooler_config,
)
from shared.messages import Pooling


@pytest.mark.parametrize(("text", "want"), [
    (None, Pooling("last", True)),
    ('{"pooling_type": "MEAN", "normalize": false}', Pooling("mean", False)),
    ('{"pooling_type": "cls"}', Pooling("cls", True)),
    ('{"seq_pooling_type": "LAST", "use_activation": false}', Pooling("last", False)),
])
def test_pooler_config(text, want):
    assert parse_pooler_config(text) == want


@pytest.mark.parametrize(("text", "words"), [
    ('{"pooling_type": "MAX"}', "MAX"),
    ('{"pooling": "MEAN"}', "pooling_type"),
    ("not json", "pooler-config"),
])
def test_bad_pooler_config(text, words):
    with pytest.raises(PoolerConfigError, match=words):
        parse_pooler_config(text)


def test_runner_and_convert():
    assert check_runner("pooling", "embed") == "pooling"
    assert check_runner("pooling", "auto") == "pooling"
    assert check_runner("auto", "auto") == check_runner("generate", "none") == "generate"
    for runner, convert in (("generate", "embed"), ("pooling", "none")):
        with pytest.raises(PoolerConfigError):
            check_runner(runner, convert)


def test_flags_reach_the_engine_and_are_checked():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--runner", "pooling", "--convert", "embed",
                              "--pooler-config", '{"pooling_type": "MEAN"}'])
    assert check_engine_args(args) is None
    argv = engine_argv(args)
    assert argv[argv.index("--runner") + 1] == "pooling"
    assert argv[argv.index("--pooler-config") + 1] == '{"pooling_type": "MEAN"}'
    bad = parser.parse_args(["--runner", "generate", "--convert", "embed"])
    assert "--runner pooling" in check_engine_args(bad)


@pytest.mark.parametrize(("kind", "start", "num_new", "want"), [
    ("last", 0, 10, [9]), ("last", 0, 4, []), ("last", 8, 2, [1]),
    ("cls", 0, 4, [0]), ("cls", 4, 6, []),
    ("mean", 4, 6, list(range(6))), ("mean", 8, 5, [0, 1]),  # (positions past the prompt)
])
def test_pool_positions(kind, start, num_new, want):
    assert list(pool_positions(kind, start, num_new, prompt_len=10)) == want
