"""vLLM-style command lines: underscores in flag names, --config YAML files, engine flag checks."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shared.argv import ConfigFileError, normalize
from shared.engine_args import add_engine_args, check_engine_args, engine_argv


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    add_engine_args(parser)
    return parser


def test_underscores_become_dashes_in_flag_names_only() -> None:
    argv = ["/models/my_model", "--max_model_len", "64", "--served_model_name=a_b", "-x"]
    assert normalize(argv) == ["/models/my_model", "--max-model-len", "64",
                               "--served-model-name=a_b", "-x"]


def test_config_file_flags_come_first_so_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("max_model_len: 64\nenforce-eager: true\nenable_prefix_caching: false\n"
                      "trust_remote_code: false\nseed: 3\n")
    parser = engine_parser()
    argv = normalize(["m", "--config", str(config), "--seed", "5"], parser)
    # trust_remote_code has no --no- form: false leaves it out
    assert argv == ["--max-model-len", "64", "--enforce-eager", "--no-enable-prefix-caching",
                    "--seed", "3", "m", "--seed", "5"]
    args = parser.parse_args(argv)
    assert (args.max_model_len, args.seed, args.enable_prefix_caching) == (64, 5, False)


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigFileError, match="mapping"):
        normalize(["--config", str(config)])
    with pytest.raises(ConfigFileError):
        normalize(["--config", str(tmp_path / "missing.yaml")])


def test_vllm_aliases_reach_the_engine_under_tandems_names() -> None:
    args = engine_parser().parse_args(["--kv-cache-memory-bytes", "1000",
                                       "--num-gpu-blocks-override", "7"])
    argv = engine_argv(args)
    assert argv[argv.index("--kv-cache-memory") + 1] == "1000"
    assert argv[argv.index("--num-kv-blocks") + 1] == "7"


def test_quantization_reaches_the_engine() -> None:
    argv = engine_argv(engine_parser().parse_args(["-q", "fp8"]))
    assert argv[argv.index("--quantization") + 1] == "fp8"
    assert "--quantization" not in engine_argv(engine_parser().parse_args([]))
    with pytest.raises(SystemExit):  # argparse names the choices
        engine_parser().parse_args(["--quantization", "gptq"])


@pytest.mark.parametrize(("flags", "problem"), [
    (["--tensor-parallel-size", "0"], "at least 1"),
    (["--max-logprobs", "21"], "between 0 and 20"),
    (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--kv-cache-dtype", "fp8_e5m2"], "'fp8_e5m2' is not supported: choose auto"),
    (["--calculate-kv-scales"], "needs an fp8 KV cache"),
])
def test_engine_flags_that_cannot_be_served_are_named(flags: list[str], problem: str) -> None:
    message = check_engine_args(engine_parser().parse_args(flags))
    assert message is not None and problem in message


def test_plain_flags_pass_the_checks() -> None:
    args = engine_parser().parse_args(["--tensor-parallel-size", "1", "--max-logprobs", "5",
                                       "--gpu-memory-utilization", "0.9"])
    assert check_engine_args(args) is None
    speculating = engine_parser().parse_args(["--tensor-parallel-size", "2",
                                              "--speculative-config",
                                              '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert check_engine_args(speculating) is None


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3"])
def test_the_fp8_kv_cache_flags_reach_the_engine(dtype: str) -> None:
    args = engine_parser().parse_args(["--kv-cache-dtype", dtype, "--calculate-kv-scales"])
    assert check_engine_args(args) is None
    argv = engine_argv(args)
    assert argv[argv.index("--kv-cache-dtype") + 1] == dtype and "--calculate-kv-scales" in argv
    assert "--calculate-kv-scales" not in engine_argv(engine_parser().parse_args([]))
