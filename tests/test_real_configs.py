"""The Kimi K2.6 and DeepSeek V3 config sets: each file loads, every setting it names resolves against the
target's shapes checked into configs/targets/ (weights and tokenizer aside), and the commands in its header
name files and modules that exist."""

import re
from importlib.util import find_spec
from pathlib import Path

import pytest

from scripts.cli import VERBS
import torch
import tomllib

from configs.schema import load_config
from engines.settings import vllm_kwargs
from drafters.drafter.model import DFlashDrafter
from drafters.target.loading import load_target_config
from train.setup import resolve_draft_config

REPO = Path(__file__).resolve().parents[1]
SETS = {"kimi-k2.6": 163_840, "deepseek-v3": 129_280}
STAGES = ("", "-finetune", "-retrain")


def _header(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))


@pytest.mark.parametrize("name", sorted(SETS))
@pytest.mark.parametrize("stage", STAGES)
def test_each_config_of_the_set_resolves_against_the_target_shapes(name, stage):
    path = REPO / "configs" / f"{name}{stage}.yaml"
    shapes = REPO / "configs" / "targets" / name
    config = load_config(path, [f"target.path={shapes}", "drafter.mask_token_id=128000"])
    target = load_target_config(shapes, trust_remote_code=False)
    assert target.vocab_size == SETS[name] and target.num_hidden_layers == 61 and target.hidden_size == 7168

    draft = resolve_draft_config(config, shapes, target)
    with torch.device("meta"):
        drafter = DFlashDrafter(draft)
    assert drafter.target_layer_ids == [1, 15, 30, 44, 58] and draft.hidden_size == 7168
    assert config.target.trust_remote_code and config.target.feature_backend == "vllm"
    engine = vllm_kwargs(config.target, shapes, max_model_len=config.data.max_seq_len)
    assert engine["tensor_parallel_size"] == 8 and engine["enable_expert_parallel"]
    assert config.features.mode == "offline" and config.features.dtype == "fp8"

    if stage == "":
        assert config.train.stage == "general" and config.train.trust_checkpoint_pickles
        sources = config.data.mixture.source_list
        assert sources and all(s.path and s.format for s in sources)
    if stage == "-finetune":
        assert config.train.stage == "finetune" and config.data.trajectories
        assert config.train.init_from == load_config(REPO / "configs" / f"{name}.yaml",
                                                     [f"target.path={shapes}"]).output_dir
    if stage == "-retrain":
        assert config.retrain.trajectories and config.retrain.serving_check and "fp8" in config.retrain.export_dtypes
        assert config.retrain.initial_drafter == load_config(REPO / "configs" / f"{name}-finetune.yaml",
                                                             [f"target.path={shapes}"]).output_dir


@pytest.mark.parametrize("name", sorted(SETS))
@pytest.mark.parametrize("stage", STAGES)
def test_the_launch_lines_in_each_header_name_what_exists(name, stage):
    header = _header(REPO / "configs" / f"{name}{stage}.yaml")
    assert f"configs/{name}{stage}.yaml" in header  # every command takes this very file
    for module in re.findall(r"-m ([\w.]+)", header):
        assert find_spec(module) is not None, module
    for verb in re.findall(r"(?:dflash-pipeline|-m scripts\.cli) ([\w-]+)", header):
        assert verb in VERBS, verb
    for named in re.findall(r"((?:configs|scripts|train)/[\w./-]+\.(?:yaml|py))", header):
        assert (REPO / named).is_file(), named


def test_kimi_tokenizer_dependency_is_declared():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("tiktoken") for req in extras["kimi"])
