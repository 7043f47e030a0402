"""Speculative decoding: a drafter trained with the training forward accepts tokens at inference, and our
decoder agrees token for token and step for step with the reference `dflash_generate`."""

import time

import pytest
import torch

import dflash.model as reference
from configs.schema import DrafterConfig
from drafters.drafter.blocks import block_positions
from drafters.target.capture import HFCapture
from drafters.drafter.checkpoint import save_drafter
from drafters.drafter.config import build_draft_config
from drafters.target.frozen import FrozenTargetHead
from drafters.drafter.model import DFlashDrafter
from drafters.decoding.spec_decode import accept_sampled, generate
from drafters.target.testbed import tiny_llama_target

B, NEW = 8, 48
PROMPT = torch.tensor([[5, 90, 123, 77, 400, 12, 9, 300]])


@pytest.fixture(scope="module")
def trained():
    """A chaotic tiny target (random weights x 8, 512 tokens) and a drafter fit to its greedy output.

    60 steps of CE on the target's own continuation: enough to accept several tokens per step,
    not enough to accept them all, so acceptance lengths vary from step to step.
    """
    target = tiny_llama_target(seed=0, vocab_size=512)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(8)
    greedy = target.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    config = build_draft_config(DrafterConfig(num_layers=1, block_size=B, num_target_features=3), target.config, 511)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    head = FrozenTargetHead.from_model(target)
    capture = HFCapture(target, drafter.target_layer_ids)
    features = capture.capture(greedy).selected
    capture.remove()
    seq_len, n = greedy.shape[1], PROMPT.shape[1]
    anchors = torch.arange(n - 1, seq_len - 1)[None]
    positions = block_positions(anchors, B)[..., 1:]  # slot k predicts the token at a + k
    valid = positions < seq_len
    labels = greedy[0, positions.clamp(max=seq_len - 1)]
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(60):
        logits = head.logits(drafter(features, greedy, anchors, head.embed)[:, :, 1:])
        loss = torch.nn.functional.cross_entropy(logits[valid], labels[valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, drafter.eval(), greedy


def test_greedy_matches_target_and_reference_step_for_step(trained, tmp_path, monkeypatch):
    target, drafter, greedy = trained
    ours = generate(drafter, target, PROMPT, NEW)
    assert torch.equal(ours.output_ids, greedy)
    assert ours.tau > 2.0, ours.acceptance_lengths  # training labels line up with inference slots
    assert len(set(ours.acceptance_lengths)) > 2
    assert sum(ours.acceptance_lengths) == NEW - 1  # the first token comes from the prefill

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # the reference assumes CUDA
    save_drafter(drafter, tmp_path / "drafter")
    ref_model = reference.DFlashDraftModel.from_pretrained(tmp_path / "drafter", dtype=torch.float32).eval()
    theirs = reference.dflash_generate(ref_model, target, PROMPT, NEW, None, return_stats=True)
    assert torch.equal(theirs.output_ids, greedy)
    assert ours.acceptance_lengths == theirs.acceptance_lengths


def test_stop_ids_and_max_new_tokens(trained):
    target, drafter, greedy = trained
    stop = int(greedy[0, PROMPT.shape[1] + 10])
    out = generate(drafter, target, PROMPT, NEW, stop_ids=[stop])
    new = out.output_ids[0, PROMPT.shape[1]:].tolist()
    first = greedy[0, PROMPT.shape[1]:].tolist().index(stop)
    assert new == greedy[0, PROMPT.shape[1]: PROMPT.shape[1] + first + 1].tolist()
    short = generate(drafter, target, PROMPT, 5)
    assert torch.equal(short.output_ids, greedy[:, : PROMPT.shape[1] + 5])


def test_near_zero_temperature_sampling_reproduces_greedy(trained):
    target, drafter, greedy = trained
    # This target has top-2 logit gaps of 1e-4, so T must be far below that for sampling to be greedy.
    out = generate(drafter, target, PROMPT, NEW, temperature=1e-7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.output_ids, greedy)
    assert out.tau > 2.0


def test_rejection_sampling_emits_the_target_distribution():
    """One drafted slot: the first emitted token must follow the target's p exactly, whatever q is."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])  # rows: slot 1, bonus
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]])
    trials = 20000
    drafts = torch.multinomial(q[0], trials, replacement=True, generator=g)
    counts = torch.zeros(5)
    accepted_total = 0
    for x in drafts:
        accepted, token = accept_sampled(x[None], q, p, g)
        counts[int(x) if accepted else token] += 1
        accepted_total += accepted
    torch.testing.assert_close(counts / trials, p[0], atol=0.015, rtol=0)
    # Acceptance rate of speculative sampling is sum_x min(p, q).
    assert abs(accepted_total / trials - torch.minimum(p[0], q[0]).sum().item()) < 0.015
