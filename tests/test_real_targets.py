"""Targets as their owners ship them: a tiny Kimi-K2-shaped folder that needs its own code (config, model and
tokenizer classes named in auto_map, Kimi's special tokens at their ids, Kimi's chat template), and exact
assistant masks for Kimi and DeepSeek-V3 on multi-turn tool conversations."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from drafters.target.chat import (KIMI_K2_TEMPLATE, ChatMaskError, EndOfTurnNotFoundError, encode, end_of_turn_ids,
                             load_deepseek_v3_tokenizer, load_tokenizer, mask_conversation, mask_generation, render,
                             set_thinking, template_end_of_turn)
from drafters.target.loading import TargetLoadError, load_target_config, load_target_model, load_target_tokenizer
from drafters.target.testbed import save_tiny_target

REPO = Path(__file__).resolve().parents[1]
KIMI_SPECIAL = {  # ids as in Kimi K2's tokenizer_config.json
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588,
    "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597, "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599, "<|im_middle|>": 163601, "<think>": 163606, "</think>": 163607,
    "[UNK]": 163838, "[PAD]": 163839,
}
CONFIG_CODE = '''from transformers import DeepseekV3Config as _Upstream


class DeepseekV3Config(_Upstream):
    model_type = "kimi_k2"
'''
MODEL_CODE = '''from transformers import DeepseekV3ForCausalLM as _Upstream

from .configuration_deepseek import DeepseekV3Config


class DeepseekV3ForCausalLM(_Upstream):
    config_class = DeepseekV3Config
'''
TOKENIZER_CODE = '''from transformers import PreTrainedTokenizerFast


class TikTokenTokenizer(PreTrainedTokenizerFast):
    """Stands in for Kimi's tiktoken class: same name, loaded only as the folder's own code."""
'''
CORPUS = ["def reverse(xs):\n    return xs[::-1]\n", "Read the file and list the functions.", "The weather is sunny.",
          '{"path": "src/app.py", "line": 12}', "I will call the tool now.", "Done: the tests pass."] * 20


def _kimi_tokenizer_json(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator(CORPUS, BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                   show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {**model["vocab"], **KIMI_SPECIAL}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in KIMI_SPECIAL])
    tokenizer.save(str(path))


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory) -> Path:
    """Kimi-K2-shaped target folder: DeepSeek-V3 weights at Kimi's vocabulary, its own code, its template."""
    folder = save_tiny_target("kimi", tmp_path_factory.mktemp("kimi") / "Kimi-K2-tiny")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kimi_k2", bos_token_id=163584, eos_token_id=163585, pad_token_id=163839, auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3ForCausalLM",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(bos_token_id=163584, eos_token_id=163585)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    (folder / "configuration_deepseek.py").write_text(CONFIG_CODE)
    (folder / "modeling_deepseek.py").write_text(MODEL_CODE)
    (folder / "tokenization_kimi.py").write_text(TOKENIZER_CODE)
    _kimi_tokenizer_json(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "model_max_length": 262144}))
    shutil.copy(KIMI_K2_TEMPLATE, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def kimi(kimi_folder):
    return load_tokenizer(kimi_folder, trust_remote_code=True)


TOOL_SESSION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What does src/app.py define?"},
    {"role": "assistant", "content": "I will read it.", "reasoning_content": "Read the file first.",
     "tool_calls": [{"id": "functions.read_file:0", "type": "function",
                     "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}]},
    {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "def reverse(xs):\n    return xs[::-1]\n"},
    {"role": "assistant", "content": "It defines reverse.", "reasoning_content": "One function."},
]
FOLLOW_UP = [{"role": "user", "content": "Run the tests."},
             {"role": "assistant", "content": "Done: the tests pass.", "reasoning_content": "Call the runner."}]


def test_untrusted_kimi_folder_is_refused_naming_the_setting(kimi_folder):
    for load in (load_target_config, load_target_tokenizer, load_tokenizer):
        with pytest.raises(TargetLoadError, match=r"target\.trust_remote_code: true") as err:
            load(kimi_folder)
        assert str(kimi_folder) in str(err.value)


def test_trusted_kimi_folder_loads_its_own_classes(kimi_folder, kimi):
    import torch

    config = load_target_config(kimi_folder, trust_remote_code=True)
    assert config.model_type == "kimi_k2" and config.vocab_size == 163_840
    assert type(kimi).__name__ == "TikTokenTokenizer" and type(kimi).__module__.startswith("transformers_modules")
    assert kimi.convert_tokens_to_ids(["<|im_end|>", "[EOS]", "<think>"]) == [163586, 163585, 163606]
    model = load_target_model(kimi_folder, dtype=torch.float32, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules") and not model.training
    ids = torch.tensor([encode(kimi, render(kimi, TOOL_SESSION[:2], add_generation_prompt=True))])
    assert model(ids).logits.shape == (1, ids.shape[1], 163_840)


def test_kimi_end_of_turn_comes_from_the_template_not_eos(kimi):
    assert kimi.eos_token == "[EOS]"
    assert template_end_of_turn(kimi) == "<|im_end|>"
    assert end_of_turn_ids(kimi) == [163586, 163585]


def _masked_pieces(tok, conv):
    return [tok.decode(conv.input_ids[s:e]) for s, e in conv.assistant_spans]


def test_kimi_masks_exact_on_a_multi_turn_tool_session_thinking_on(kimi):
    conv = mask_conversation(kimi, TOOL_SESSION)
    assert conv.input_ids == encode(kimi, render(kimi, TOOL_SESSION))
    assert _masked_pieces(kimi, conv) == [
        "Read the file first.</think>I will read it.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.read_file:0<|tool_call_argument_begin|>{"path": "src/app.py"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
        "One function.</think>It defines reverse.<|im_end|>",
    ]
    tokens = kimi.convert_ids_to_tokens(conv.input_ids)
    for start, end in conv.assistant_spans:  # header and the opened <think> are prompt; <|im_end|> is generated
        assert tokens[start - 1] == "<think>" and tokens[start - 2] == "<|im_middle|>"
        assert kimi.decode(conv.input_ids[:start]).endswith("<|im_assistant|>assistant<|im_middle|><think>")
        assert tokens[end - 1] == "<|im_end|>"
    assert sum(conv.loss_mask) == sum(e - s for s, e in conv.assistant_spans)
    # Everything else is unmasked: default-less system turn, user turn, the tool result turn.
    unmasked = kimi.decode([t for t, m in zip(conv.input_ids, conv.loss_mask) if not m])
    assert unmasked == ("<|im_system|>system<|im_middle|>You are a coding agent.<|im_end|><|im_user|>user<|im_middle|>"
                        "What does src/app.py define?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
                        "<|im_system|>tool<|im_middle|>## Return of functions.read_file:0\n"
                        "def reverse(xs):\n    return xs[::-1]\n<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    # The target's own generation (prompt ids + generated ids) is the same sequence as the template's.
    last_start, last_end = conv.assistant_spans[-1]
    generated = conv.input_ids[last_start:last_end]
    assert mask_generation(kimi, TOOL_SESSION[:-1], generated).input_ids == conv.input_ids[:last_end]


def test_kimi_thinking_switch(kimi_folder):
    off = load_tokenizer(kimi_folder, trust_remote_code=True, thinking=False)
    assert render(off, TOOL_SESSION[:2], add_generation_prompt=True).endswith("<|im_middle|><think></think>")
    conv = mask_conversation(off, TOOL_SESSION + FOLLOW_UP)
    # Thinking off: every reply starts after a closed, empty <think></think>; reasoning is never rendered.
    assert _masked_pieces(off, conv) == [
        "I will read it.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>"
        '{"path": "src/app.py"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "It defines reverse.<|im_end|>", "Done: the tests pass.<|im_end|>"]
    tokens = off.convert_ids_to_tokens(conv.input_ids)
    assert all(tokens[s - 2:s] == ["<think>", "</think>"] for s, _ in conv.assistant_spans)
    on = load_tokenizer(kimi_folder, trust_remote_code=True, thinking=True)
    assert render(on, TOOL_SESSION[:2], add_generation_prompt=True).endswith("<|im_middle|><think>")
    # Thinking on, a second user turn: earlier replies lose their reasoning, which the template rewrites
    # (not prefix-stable), so that conversation is refused rather than masked wrongly.
    with pytest.raises(ChatMaskError, match="not prefix-stable"):
        mask_conversation(on, TOOL_SESSION + FOLLOW_UP)


def test_thinking_on_a_template_without_a_switch_is_refused():
    with pytest.raises(ChatMaskError, match="data.thinking"):
        set_thinking(load_deepseek_v3_tokenizer(), True)


DEEPSEEK_TOOL_SESSION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read both files."},
    {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
        {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "b.py"}'}}]},
    {"role": "tool", "content": "x = 1"},
    {"role": "tool", "content": "y = 2"},
    {"role": "assistant", "content": "a.py sets x, b.py sets y."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You are welcome."},
]


def test_deepseek_masks_exact_on_a_multi_turn_tool_session():
    tok = load_deepseek_v3_tokenizer()
    assert template_end_of_turn(tok) == tok.eos_token == "<｜end▁of▁sentence｜>"  # DeepSeek-V3 stays as it is
    conv = mask_conversation(tok, DEEPSEEK_TOOL_SESSION)
    assert conv.input_ids == encode(tok, render(tok, DEEPSEEK_TOOL_SESSION))
    assert _masked_pieces(tok, conv) == [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n{\"path\": \"a.py\"}\n```"
        "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n{\"path\": \"b.py\"}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "a.py sets x, b.py sets y.<｜end▁of▁sentence｜>",
        "You are welcome.<｜end▁of▁sentence｜>",
    ]
    tokens = tok.convert_ids_to_tokens(conv.input_ids)
    assert [tokens[s - 1] for s, _ in conv.assistant_spans] == ["<｜Assistant｜>", "<｜tool▁outputs▁end｜>", "<｜Assistant｜>"]
    unmasked = tok.decode([t for t, m in zip(conv.input_ids, conv.loss_mask) if not m])
    assert unmasked == ("<｜begin▁of▁sentence｜>You are a coding agent.<｜User｜>Read both files.<｜Assistant｜>"
                        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>x = 1<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>"
                        "y = 2<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜User｜>Thanks.<｜Assistant｜>")
    # DeepSeek-V3's published template never closes a single-call turn: refused, not masked to the next turn.
    single = DEEPSEEK_TOOL_SESSION[:2] + [{"role": "assistant", "tool_calls": DEEPSEEK_TOOL_SESSION[2]["tool_calls"][:1]},
                                          {"role": "tool", "content": "x = 1"}, DEEPSEEK_TOOL_SESSION[5]]
    with pytest.raises(EndOfTurnNotFoundError):
        mask_conversation(tok, single)


def _train(kimi_folder: Path, data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([
        sys.executable, str(REPO / "train" / "dflash.py"), "--config", str(REPO / "configs" / "testbed.yaml"),
        f"output_dir={out}", f"target.path={kimi_folder}", f"data.dataset={data}", "drafter.num_layers=1",
        "drafter.num_target_features=2", "train.batch_size=2", "train.anchors_per_seq=4", "train.max_steps=2",
        "train.dtype=fp32", "logging.wandb=false", *extra,
    ], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_training_on_the_kimi_folder_needs_and_uses_trust_remote_code(kimi_folder, kimi, tmp_path):
    rows = []
    for session in (TOOL_SESSION, TOOL_SESSION[:3], [TOOL_SESSION[1], TOOL_SESSION[4]]):
        conv = mask_conversation(kimi, session)
        rows.append({"input_ids": conv.input_ids, "loss_mask": conv.loss_mask})
    Dataset.from_list(rows * 2).save_to_disk(str(tmp_path / "data"))
    refused = _train(kimi_folder, tmp_path / "data", tmp_path / "refused")
    assert refused.returncode == 2 and "target.trust_remote_code" in refused.stderr, refused.stderr[-2000:]
    # Trusted: config, tokenizer (the mask token is chosen from it), target weights and capture all load.
    trained = _train(kimi_folder, tmp_path / "data", tmp_path / "run", "target.trust_remote_code=true")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "drafter" / "model.safetensors").exists()
