"""The one engine setting block: what each engine is started with, what the config refuses when it loads, and
the SGLang adapter's requests and answers (sglang itself is GPU-only; its output format is SGLang's own)."""

from importlib.util import find_spec
from itertools import product

import pytest

from configs.schema import ConfigError, TargetConfig, load_config
from engines.settings import EngineSettingsError, context_length, sglang_kwargs, vllm_kwargs
from engines.sglang.generation import EngineOutputError, response_ids, sampling_params

KIMI_LIKE = TargetConfig(backend="vllm", dtype="bf16", tensor_parallel=8, pipeline_parallel=2, expert_parallel=True,
                         max_model_len=8192, memory_share=0.9, quantization="fp8", trust_remote_code=True)


def test_one_block_starts_vllm_and_sglang_alike():
    v = vllm_kwargs(KIMI_LIKE, "/models/kimi", max_model_len=8192, seed=3)
    assert {k: v[k] for k in ("model", "dtype", "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                              "max_model_len", "gpu_memory_utilization", "quantization", "trust_remote_code", "seed")} == {
        "model": "/models/kimi", "dtype": "bfloat16", "tensor_parallel_size": 8, "pipeline_parallel_size": 2,
        "enable_expert_parallel": True, "max_model_len": 8192, "gpu_memory_utilization": 0.9, "quantization": "fp8",
        "trust_remote_code": True, "seed": 3}
    s = sglang_kwargs(KIMI_LIKE, "/models/kimi", max_model_len=8192, seed=3)
    assert s == {"model_path": "/models/kimi", "dtype": "bfloat16", "context_length": 8192, "tp_size": 8, "pp_size": 2,
                 "ep_size": 8, "mem_fraction_static": 0.9, "trust_remote_code": True, "random_seed": 3,
                 "skip_tokenizer_init": True, "quantization": "fp8"}
    plain = vllm_kwargs(TargetConfig(dtype="fp32"), "/m", max_model_len=512)
    assert "enable_expert_parallel" not in plain and "quantization" not in plain and plain["tensor_parallel_size"] == 1


def test_a_context_shorter_than_the_job_is_refused_naming_the_key():
    assert context_length(TargetConfig(), 8192, "regeneration") == 8192
    assert context_length(KIMI_LIKE, 4096, "regeneration") == 8192
    with pytest.raises(EngineSettingsError, match="target.max_model_len=8192 is shorter than regeneration needs"):
        context_length(KIMI_LIKE, 8192 + 1, "regeneration")


def test_no_config_that_loads_leaves_a_backend_without_a_capture():
    """Every combination of backends either loads with a capture this pipeline has, or is refused naming the key."""
    loaded = 0
    for backend, capture, generation in product(("hf", "vllm", "sglang"), (None, "hf", "vllm"), (None, "hf", "vllm", "sglang")):
        overrides = [f"target.backend={backend}"] + ([f"target.capture_backend={capture}"] if capture else []) + (
            [f"data.mixture.generation_backend={generation}"] if generation else [])
        try:
            config = load_config(None, overrides)
        except ConfigError as err:
            assert any(key in str(err) for key in ("target.capture_backend", "target.backend",
                                                   "data.mixture.generation_backend")), str(err)
            continue
        loaded += 1
        assert config.target.feature_backend in ("hf", "vllm")
        assert config.generation_backend in ("hf", "vllm", "sglang")
    assert loaded >= 4


def test_engine_settings_that_cannot_apply_are_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="target.capture_backend"):
        load_config(None, ["target.backend=sglang"])
    if find_spec("sglang") is None:  # this machine (sglang has no CPU build)
        with pytest.raises(ConfigError, match="target.backend: sglang is not installed"):
            load_config(None, ["target.backend=sglang", "target.capture_backend=hf"])
    with pytest.raises(ConfigError, match="target.device_map"):
        load_config(None, ["target.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="memory_share"):
        load_config(None, ["target.memory_share=1.5"])


def test_sglang_requests_are_greedy_or_seeded_and_keep_the_stop_token():
    assert sampling_params(64, 0.0, 1.0, 0, [2, 7], seed=5) == {
        "max_new_tokens": 64, "temperature": 0.0, "stop_token_ids": [2, 7], "skip_special_tokens": False,
        "no_stop_trim": True}
    sampled = sampling_params(64, 0.7, 0.9, 0, [2], seed=5)
    assert sampled["top_p"] == 0.9 and sampled["top_k"] == -1 and sampled["sampling_seed"] == 5


def test_sglang_answers_are_parsed_or_refused_naming_the_request():
    stop = {2}
    finished = {"text": "hi", "output_ids": [11, 12, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                                                     "prompt_tokens": 4, "completion_tokens": 3}}
    assert response_ids(finished, 0, stop) == [11, 12, 2]
    trimmed = {"output_ids": [11, 12], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
    assert response_ids(trimmed, 1, stop) == [11, 12, 2]  # a version that trims the stop token: put back
    cut = {"output_ids": [11, 12, 13], "meta_info": {"finish_reason": {"type": "length", "length": 3}}}
    assert response_ids(cut, 2, stop) == [11, 12, 13]
    by_string = {"output_ids": [11], "meta_info": {"finish_reason": {"type": "stop", "matched": "</s>"}}}
    assert response_ids(by_string, 3, stop) == [11]
    with pytest.raises(EngineOutputError, match="#4 was aborted"):
        response_ids({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}}, 4, stop)
    for bad in ({"text": "no ids"}, {"output_ids": [1, "2"]}, {"output_ids": [1, -3]}, ["not", "a", "dict"]):
        with pytest.raises(EngineOutputError, match="SGLang answer #5"):
            response_ids(bad, 5, stop)
