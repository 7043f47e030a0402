from pathlib import Path

import pytest

from configs.schema import ConfigError, PipelineConfig, dump_config, load_config, migrate_settings

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    config = load_config(path)
    assert isinstance(config, PipelineConfig)
    # The CPU recipes (quickstart and full) draft blocks of 8 (BENCHMARKS.md, issue 12), and so does the closed loop,
    # whose v0 is the quickstart's; every other shipped config 16.
    block_8 = ("testbed.yaml", "testbed-full.yaml", "closed-loop-testbed.yaml")
    assert config.drafter.block_size == (8 if path.name in block_8 else 16)


def test_dotted_overrides_are_typed():
    config = load_config(CONFIGS[0], ["train.lr=3e-4", "drafter.target_layer_ids=[1, 8, 14]", "train.max_steps=5"])
    assert config.train.lr == pytest.approx(3e-4)
    assert config.drafter.target_layer_ids == [1, 8, 14]
    assert config.train.max_steps == 5


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n  warmpu_ratio: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.warmpu_ratio'"):
        load_config(path)


def test_mistyped_value_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("drafter:\n  num_layers: two\n")
    with pytest.raises(ConfigError, match=r"config key 'drafter\.num_layers'.*'two'"):
        load_config(path)


def test_unknown_override_is_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr'"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["train.lr"])


def test_dump_round_trips(tmp_path):
    config = load_config(CONFIGS[0], ["train.epochs=7"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_max_steps_must_be_at_least_one():
    assert load_config(None, ["train.max_steps=null"]).train.max_steps is None  # no limit: epochs decide
    for bad in ("-1", "0"):
        with pytest.raises(ConfigError, match=r"'train\.max_steps': Input should be greater than or equal to 1"):
            load_config(None, [f"train.max_steps={bad}"])


def test_the_tv_blend_needs_a_ce_loss():
    assert load_config(None, ["train.loss=ce_target", "train.tv_eta=3"]).train.tv_eta == 3.0
    with pytest.raises(ConfigError, match=r"train\.tv_eta blends total variation into a CE loss"):
        load_config(None, ["train.loss=kl", "train.tv_eta=3"])


def test_the_copy_value_loss_needs_copy_heads():
    assert load_config(None, ["train.copy_heads=2", "train.copy_value_weight=1"]).train.copy_value_weight == 1.0
    with pytest.raises(ConfigError, match=r"train\.copy_value_weight trains the copy heads' values: it needs train\.copy_heads"):
        load_config(None, ["train.copy_heads=0", "train.copy_value_weight=1"])


def test_category_repeats_must_name_a_category_the_mixture_builds():
    assert load_config(None, ["train.category_repeats={chat: 2}"]).train.category_repeats == {"chat": 2}
    with pytest.raises(ConfigError, match=r"train\.category_repeats names \['caht'\], which the mixture does not build"):
        load_config(None, ["train.category_repeats={caht: 2}"])
    with pytest.raises(ConfigError, match=r"'train\.category_repeats\.chat': Input should be greater than or equal to 1"):
        load_config(None, ["train.category_repeats={chat: 0}"])


def test_auto_dtype_is_bf16_only_where_the_hardware_multiplies_it_natively():
    import torch

    from common.dtypes import native_bf16, torch_dtype

    assert native_bf16("cpu", frozenset({"avx2", "fma"})) is False  # AMD Zen 3: bf16 emulated, ~5x slower than fp32
    assert native_bf16("cpu", frozenset({"avx512f", "avx512_bf16"})) is True
    assert native_bf16("cpu", frozenset({"amx_tile", "amx_bf16"})) is True
    assert torch_dtype("auto") == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert torch_dtype("bf16") == torch.bfloat16 and torch_dtype("float32") == torch.float32
    with pytest.raises(KeyError, match="'auto'"):
        torch_dtype("int8")
    assert load_config(None, []).target.dtype == "auto"


def test_the_retrain_gate_takes_the_eval_sections_keys():
    config = load_config(None, ["retrain.eval.max_prompts=3", "retrain.eval.dtype=bf16"])
    assert (config.retrain.eval.max_prompts, config.retrain.eval.dtype) == (3, "bf16")
    assert (config.retrain.eval.max_new_tokens, config.eval.max_new_tokens) == (64, 128)  # each keeps its defaults
    with pytest.raises(ConfigError, match=r"unknown config key 'retrain\.eval_max_prompts'"):
        load_config(None, ["retrain.eval_max_prompts=3"])
    with pytest.raises(ConfigError, match=r"'retrain\.eval\.temperature': Input should be less than or equal to 0"):
        load_config(None, ["retrain.eval.temperature=0.5"])


def test_moved_keys_and_other_dtype_spellings_are_refused_naming_the_new_ones(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("features:\n  cache_dtype: fp8\neval:\n  agentic_log: [logs/heldout]\n"
                   "retrain:\n  incoming: [logs/incoming]\n  export_dtypes: [bfloat16]\n")
    with pytest.raises(ConfigError) as refused:
        load_config(old)
    message = str(refused.value)
    assert str(old) in message
    for moved, new in [("features.cache_dtype", "features.dtype"), ("eval.agentic_log", "eval.trajectories"),
                       ("retrain.incoming", "retrain.trajectories")]:
        assert f"{moved!r} is now {new!r}" in message
    assert "'retrain.export_dtypes': ['bfloat16'] is spelled ['bf16']" in message
    with pytest.raises(ConfigError, match="'train.precision' is now 'train.dtype'"):
        load_config(None, ["train.precision=bf16"])
    with pytest.raises(ConfigError, match="'eval.dtype': 'float32' is spelled 'fp32'"):
        load_config(None, ["eval.dtype=float32"])
    # The same settings as a checkpoint saved them read as they are written today.
    saved = {"train": {"precision": "float32"}, "features": {"cache_dtype": "fp8"}, "target": {"dtype": "bfloat16"},
             "eval": {"agentic_log": ["a"]}, "retrain": {"incoming": ["b"], "eval": {"dtype": "float32"}}}
    migrated = PipelineConfig.model_validate(migrate_settings(saved))
    assert (migrated.train.dtype, migrated.features.dtype, migrated.target.dtype) == ("fp32", "fp8", "bf16")
    assert (migrated.eval.trajectories, migrated.retrain.trajectories, migrated.retrain.eval.dtype) == (["a"], ["b"], "fp32")


def test_the_rows_come_from_one_decision():
    assert load_config(None, []).rows_from == "mixture"
    assert load_config(None, ["train.stage=finetune"]).rows_from == "trajectories"
    assert load_config(None, ["train.stage=finetune", "data.dataset=/some/rows"]).rows_from == "dataset"
