"""--generation-config: which sampling defaults the engine announces in Ready."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.worker.model_runner import sampling_defaults


def folder_with(tmp_path: Path, values: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return tmp_path


def test_auto_reads_the_sampling_values_the_model_sets(tmp_path: Path) -> None:
    model = folder_with(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                   "top_k": 20, "repetition_penalty": 1.05, "eos_token_id": 2})
    assert dict(sampling_defaults(EngineConfig(model=str(model)))) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_vllm_means_none_and_a_folder_is_read_instead_of_the_model(tmp_path: Path) -> None:
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    folder_with(model, {"temperature": 0.6})
    folder_with(other, {"top_p": 0.5})
    assert sampling_defaults(EngineConfig(model=str(model), generation_config="vllm")) == ()
    got = sampling_defaults(EngineConfig(model=str(model), generation_config=str(other)))
    assert dict(got) == {"top_p": 0.5}


def test_a_model_without_generation_config_has_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(EngineConfig(model=str(tmp_path))) == ()
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(EngineConfig(model=str(tmp_path), generation_config=str(tmp_path)))
