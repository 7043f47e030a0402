"""The general mixture's prefilled samples: real corpus prompts, real tokenizer."""

import pytest

from configs.schema import ConfigError, load_config
from drafters.target.chat import load_tokenizer
from data.sources.mixture import mixture_key, prefilled_rows


def _key(config, target):
    return mixture_key(config.data, config.target, target)


def _config(*overrides):
    return load_config(None, ["train.anchor_scope=sequence", "data.mixture.prefilled_samples=6", *overrides])


def test_prefilled_samples_restate_the_prompt_code(testbed_target):
    tokenizer = load_tokenizer(testbed_target)
    rows = prefilled_rows(_config().data, tokenizer)
    assert len(rows) == 6
    for row in rows:
        n = row["num_prompt_tokens"]
        assert row["num_generated"] == 0 and row["prompt_id"].startswith("prefilled:code:")
        assert row["loss_mask"] == [0] * n + [1] * (len(row["input_ids"]) - n)
        prompt = tokenizer.decode(row["input_ids"][:n])
        response = tokenizer.decode(row["input_ids"][n:-1])
        assert row["input_ids"][-1] == tokenizer.eos_token_id
        assert response.startswith("```python\n") and response.endswith("```")
        assert response in prompt  # the assistant turn copies the code the user showed


def test_prefilled_prose_samples_restate_the_prompt_excerpt(testbed_target):
    tokenizer = load_tokenizer(testbed_target)
    rows = prefilled_rows(_config("data.mixture.prefilled_weights={code: 1, prose: 2}").data, tokenizer)
    assert [row["category"] for row in rows] == ["code"] * 2 + ["prose"] * 4
    for row in rows[2:]:
        n = row["num_prompt_tokens"]
        assert row["prompt_id"].startswith("prefilled:prose:") and row["num_generated"] == 0
        response = tokenizer.decode(row["input_ids"][n:-1])
        assert response.strip() and response in tokenizer.decode(row["input_ids"][:n])  # the excerpt, verbatim


def test_prefilled_samples_need_greedy_path_training_and_leave_the_regeneration_cache_key(testbed_target):
    with pytest.raises(ConfigError, match="anchor_scope"):
        load_config(None, ["data.mixture.prefilled_samples=6"])
    assert _key(_config(), testbed_target) == _key(load_config(None, []), testbed_target)
    prose = _config("data.mixture.prefilled_weights={prose: 1}")
    assert _key(prose, testbed_target) == _key(load_config(None, []), testbed_target)
    with pytest.raises(ConfigError, match="prefilled_weights"):
        _config("data.mixture.prefilled_weights={code: 0}")


def test_the_regeneration_cache_key_follows_the_target_compute_dtype(testbed_target):
    bf16, fp32 = (_key(load_config(None, [f"target.dtype={d}"]), testbed_target) for d in ("bf16", "fp32"))
    assert bf16 != fp32  # greedy text differs between dtypes at near-ties
    auto = _key(load_config(None, ["target.dtype=auto"]), testbed_target)
    from common.dtypes import native_bf16
    assert auto == (bf16 if native_bf16("cpu") else fp32)
