"""eval/: real speculative decoding against real targets (SmolLM2-135M testbed, a tiny Llama), tiny budgets.

What must hold: a random drafter accepts nothing (tau exactly 1.0) and reproduces the target's greedy
output; prompt lookup on repetitive text accepts tokens and reproduces it too; our decoder and z-lab's
reference decoder give the same acceptance lengths on the same checkpoint, for a random and for a
trained (non-trivial) drafter; the report files hold what they promise; bad input is refused before any
decoding, with both values named.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from configs.schema import DrafterConfig, EvalConfig, PipelineConfig, TargetConfig
from drafters.target.capture import HFCapture
from drafters.target.chat import load_tokenizer, prompt_ids
from drafters.target.frozen import FrozenTargetHead
from data.trajectory.reader import write_trajectories
from drafters.drafter.checkpoint import save_drafter
from drafters.drafter.config import build_draft_config
from drafters.drafter.model import DFlashDrafter
from drafters.decoding.proposers import (
    DFlashProposer,
    DrafterWithLookup,
    PromptLookup,
    agreeing_continuation,
    ngram_lookup,
    ngram_matches,
)
from drafters.decoding.spec_decode import generate, lookup_generate, target_generate
from drafters.target.testbed import prepare_testbed_target, tiny_llama_target
from eval import acceptance
from eval.acceptance import evaluate
from scripts.cli import main as cli
from eval.engine_testbed import train_on_greedy_continuations
from eval.inputs import EvalError, load_spec, prepare, resolve_drafter
from eval.reference import load_reference_model
from eval.traces import TraceError

SMOL_MASK = 16
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def cpu_threads():
    """OpenMP threads that share a busy core run ~10x slower here: use the free cores (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(acceptance.choose_threads(None))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol():
    folder = prepare_testbed_target()
    return folder, AutoConfig.from_pretrained(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def random_drafter(smol, tmp_path_factory):
    _, target_config, _ = smol
    config = build_draft_config(DrafterConfig(num_layers=1, block_size=16), target_config, SMOL_MASK)
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(config), tmp_path_factory.mktemp("drafters") / "random")


def agentic_log(path, sessions):
    """sessions: {session_id: [input_ids of each turn]} -> a trajectory JSONL file (the logged format)."""
    records = []
    for s, turns in sessions.items():
        for t, ids in enumerate(turns):
            records.append({"session_id": s, "request_id": f"{s}-t{t}", "timestamp": 1_700_000_000 + t,
                            "parent_request_id": f"{s}-t{t - 1}" if t else None,
                            "input_ids": [int(i) for i in ids], "output_ids": [5, 6, 7]})
    write_trajectories(records, path)
    return path


def run_config(target, device_map=None, **eval_settings) -> PipelineConfig:
    """The pipeline config an evaluation reads: the target section and the eval section."""
    return PipelineConfig(target=TargetConfig(path=str(target), device_map=device_map), eval=EvalConfig(**eval_settings))


def edited_copy(src, dst, **changes):
    """A copy of a drafter folder whose config.json has some values changed."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key in ("target_layer_ids", "mask_token_id"):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ---------------------------------------------------------------------------------------------
# Prompt lookup
# ---------------------------------------------------------------------------------------------

def test_ngram_lookup_matches_the_earliest_longest_ngram():
    ctx = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert ngram_lookup(ctx, 3, 1, 4) == [9, 9, 1, 2]           # earliest [1, 2, 3], not the later one
    assert ngram_lookup([5, 6, 8, 6], 3, 1, 3) == [8, 6]         # falls back to a 1-gram, stops at the end
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 5) == []             # nothing repeats
    assert ngram_lookup([4, 4], 3, 2, 5) == []                   # min_ngram respected
    assert ngram_lookup(ctx, 3, 1, 0) == []


def test_agreeing_continuation_takes_the_occurrence_the_draft_agrees_with():
    ctx = [1, 2, 3, 7, 8, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    n, starts = ngram_matches(ctx, 3, 2)
    assert (n, starts.tolist()) == (3, [3, 8])                  # both earlier [1, 2, 3]; the suffix itself is not one
    assert agreeing_continuation(ctx, starts, [4, 5, 0], 3) == ([4, 5, 9], 2)      # the later one agrees
    assert agreeing_continuation(ctx, starts, [0, 5, 0], 3) == ([7, 8, 1], 0)      # none agrees: the earliest
    assert agreeing_continuation(ctx, starts, [4, 5, 9, 1, 2, 3], 8) == ([4, 5, 9, 1, 2, 3], 6)  # stops at the end
    assert ngram_matches([1, 2, 3], 3, 1)[0] == 0


@torch.no_grad()
def test_prompt_lookup_on_repetitive_prompt_accepts_and_equals_target(smol):
    folder, _, tokenizer = smol
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    line = "the quick brown fox jumps over the lazy dog"
    messages = [{"role": "user", "content": "Repeat this line five times:\n" + "\n".join([line] * 5)}]
    ids = torch.tensor([prompt_ids(tokenizer, messages)])
    new = 32
    alone = target_generate(target, ids, new, [tokenizer.eos_token_id])
    hf = target.generate(ids, max_new_tokens=new, do_sample=False)[0, ids.shape[1]:].tolist()
    assert alone.tokens == hf[: len(alone.tokens)] and alone.tau == 1.0
    lookup = lookup_generate(target, ids, new, [tokenizer.eos_token_id], num_draft=15)
    assert lookup.tokens == alone.tokens
    assert lookup.tau > 2.0, lookup.acceptance_lengths
    assert sum(lookup.acceptance_lengths) == len(lookup.tokens) - 1


# ---------------------------------------------------------------------------------------------
# Bad input: refused before any decoding, both values named
# ---------------------------------------------------------------------------------------------

def test_bad_inputs_are_refused_before_decoding(smol, random_drafter, tmp_path):
    folder = str(smol[0])
    base = dict(target=folder, categories=["code"], max_prompts=1, max_new_tokens=8, out=str(tmp_path / "out"))
    deep = edited_copy(random_drafter, tmp_path / "deep", target_layer_ids=[1, 8, 14, 20, 30])
    with pytest.raises(EvalError, match=r"\[30\] out of range .*num_hidden_layers 30"):
        prepare([str(deep)], run_config(**base))
    mask = edited_copy(random_drafter, tmp_path / "mask", mask_token_id=49152)
    with pytest.raises(EvalError, match=r"mask_token_id 49152 is not below the target vocab_size 49152"):
        prepare([f"m={mask}"], run_config(**base))
    vocab = edited_copy(random_drafter, tmp_path / "vocab", vocab_size=32000)
    with pytest.raises(EvalError, match=r"drafter vocab_size 32000 != target vocab_size 49152"):
        prepare([str(vocab)], run_config(**base))
    with pytest.raises(EvalError, match="not a drafter folder"):
        prepare([str(tmp_path)], run_config(**base))
    diverged = edited_copy(random_drafter, tmp_path / "diverged")
    weights = load_file(str(diverged / "model.safetensors"))
    weights["fc.weight"][0, 0] = float("inf")
    save_file(weights, str(diverged / "model.safetensors"))
    with pytest.raises(EvalError, match=r"'d' .* non-finite weights in 1 tensor\(s\) \(fc.weight\)"):
        prepare([f"d={diverged}"], run_config(**base))
    with pytest.raises(EvalError, match="unique"):
        prepare([f"a={random_drafter}", f"a={random_drafter}"], run_config(**base))

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="no usable request"):
        prepare([str(random_drafter)], run_config(**{**base, "categories": ["agentic"], "trajectories": [str(empty)]}))
    with pytest.raises(TraceError, match="needs --trajectories"):
        prepare([str(random_drafter)], run_config(**{**base, "categories": ["agentic"]}))
    with pytest.raises(TraceError, match="zero prompts .*exceed --max-tokens 20"):
        prepare([str(random_drafter)], run_config(**{**base, "max_tokens": 20}))
    # Through the CLI: exit code 2, the reason on stderr, no report written.
    assert cli(["eval", "--drafter", str(deep), "--target", folder, "--traces", "code", "--out", str(tmp_path / "cli")]) == 2
    assert cli(["eval", "--drafter", str(random_drafter), "--target", folder, "--traces", "agentic",
                 "--trajectories", str(empty), "--out", str(tmp_path / "cli")]) == 2
    assert not (tmp_path / "out" / "report.json").exists() and not (tmp_path / "cli" / "report.json").exists()


def test_drafter_kinds_resolve_and_fp8_reference_copy_matches(smol, random_drafter, tmp_path):
    from drafters.export.exporter import export_drafter

    _, target_config, _ = smol
    ckpt = tmp_path / "run" / "checkpoints" / "step-000010"
    save_drafter(load_spec(resolve_drafter(str(random_drafter)), torch.float32, target_config),
                 ckpt / "drafter")
    (ckpt / "trainer_state.json").write_text("{}")
    assert resolve_drafter(str(ckpt)).kind == "checkpoint"
    assert resolve_drafter(f"run={tmp_path / 'run'}").folder == ckpt / "drafter"
    export_drafter(random_drafter, tmp_path / "fp8", dtype="fp8", allow_unaligned=True)
    spec = resolve_drafter(f"fp8={tmp_path / 'fp8'}")
    assert (spec.name, spec.kind) == ("fp8", "fp8")
    ours = load_spec(spec, torch.float32, target_config)
    ref = load_reference_model(spec.folder, torch.float32, fp8=True, ours=ours)
    ref_state = ref.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(ref_state[name], tensor), name


# ---------------------------------------------------------------------------------------------
# End to end on the SmolLM2 testbed target, through the CLI
# ---------------------------------------------------------------------------------------------

def test_random_drafter_end_to_end_report(smol, random_drafter, tmp_path):
    folder, _, tokenizer = smol
    convo = [{"role": "user", "content": "List the files in src/."},
             {"role": "assistant", "content": "src/main.py\nsrc/util.py"},
             {"role": "user", "content": "Show src/util.py with a docstring added to every function."}]
    log = agentic_log(tmp_path / "logs" / "agent.jsonl", {
        "s1": [prompt_ids(tokenizer, convo[:1]), prompt_ids(tokenizer, convo)]})
    out = tmp_path / "report"
    rc = cli(["eval", "--drafter", f"rand={random_drafter}", "--target", str(folder), "--traces", "code,agentic",
               "--trajectories", str(log.parent), "--max-prompts", "1", "--max-new-tokens", "24",
               "--reference-subset", "1", "--max-chars", "500", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert {"settings", "target", "drafters", "methods", "categories", "prompts", "mismatches", "warnings",
            "notes"} <= set(report)
    assert report["methods"] == ["rand", "rand+lookup", "prompt_lookup", "target"]
    assert list(report["categories"]) == ["code", "agentic", "all"]
    assert report["categories"]["agentic"]["ids"] == ["s1-t1"]  # the session's last request
    assert report["mismatches"] == []
    for cat in ("code", "agentic"):
        m = report["categories"][cat]["methods"]
        rand = m["rand"]
        assert rand["tau_mean"] == 1.0 and rand["tau_median"] == 1.0 and rand["steps"] > 0
        assert rand["slot_acceptance"] == [0.0] * 15
        assert rand["identical"] == 1 and rand["mismatched"] == 0
        assert rand["sim_tau"] == 1.0
        ref = rand["reference"]
        assert ref["tau_ours"] == ref["tau_reference"] == 1.0 and ref["rel_diff"] == 0.0
        assert ref["acceptance_lengths_equal"] == ref["outputs_identical_to_target"] == 1
        assert m["target"]["tau_mean"] == 1.0 and m["target"]["tokens_per_s"] > 0
        lookup_rows = [p["results"]["prompt_lookup"] for p in report["prompts"] if p["category"] == cat]
        lookup_steps = [a for r in lookup_rows for a in r["acceptance_lengths"]]
        # The greedy continuation copies from the prompt: drafts are accepted, and the output is still the target's.
        assert m["prompt_lookup"]["tau_mean"] == sum(lookup_steps) / len(lookup_steps) > 1.0
        assert m["prompt_lookup"]["identical"] == 1
        assert len(m["prompt_lookup"]["slot_acceptance"]) == 15
        # With lookup, the random drafter's steps that copy are accepted too; the output is still the target's.
        assert m["rand+lookup"]["tau_mean"] > 1.0 and m["rand+lookup"]["identical"] == 1
    prompt = report["prompts"][0]["results"]
    assert prompt["rand"]["reference"]["acceptance_lengths"] == prompt["rand"]["acceptance_lengths"]

    md = (out / "report.md").read_text()
    table = md.split("## Acceptance length and speed")[1].split("\n\n")[1].splitlines()
    assert table[0] == "| category | prompts | rand | rand+lookup | prompt lookup | target alone |"
    assert [row.split("|")[1].strip() for row in table[2:]] == ["code", "agentic", "all"]
    assert "**1.00** / 1" in table[2]
    assert "identical to the target's own greedy output" in md
    serve = md.split("## What to serve")[1].split("\n\n")[1].splitlines()
    assert [row.split("|")[1].strip() for row in serve[2:]] == ["code", "agentic", "all"]
    assert all(row.split("|")[4].strip() in ("rand+lookup", "prompt lookup") for row in serve[2:])  # rand: tau 1
    for row in serve[2:]:
        methods = report["categories"][row.split("|")[1].strip()]["methods"]
        if methods["rand+lookup"]["tau_mean"] == methods["prompt_lookup"]["tau_mean"]:
            assert row.split("|")[4].strip() == "prompt lookup"  # a tie goes to the method without drafter passes
    # The export's model card takes the report: the drafter, the drafter with lookup and lookup, and what to serve.
    assert cli(["export", str(random_drafter), str(tmp_path / "export"), "--dtype", "bf16",
                "--model-card-info", str(out / "report.json")]) == 0
    card = (tmp_path / "export" / "README.md").read_text()
    assert "| category | drafter | drafter with lookup | prompt lookup | serve |" in card
    rows = [line for line in card.splitlines() if line.startswith(("| code |", "| agentic |"))]
    assert len(rows) == 2 and all(row.split("|")[5].strip() != "drafter" for row in rows)  # rand never wins
    assert f"# DFlash drafter for {folder}" in card
    for name in ("tau_by_category.png", "slot_acceptance.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        import matplotlib.image

        assert matplotlib.image.imread(out / name).shape[0] > 100


# ---------------------------------------------------------------------------------------------
# A trained (non-trivial) drafter: ours vs the reference decoder, greedy and sampled (tiny target)
# ---------------------------------------------------------------------------------------------

B, NEW = 8, 40


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A chaotic tiny Llama target (random weights x 8, vocab 512) saved as a folder, three logged agent
    sessions, and a drafter trained 60 steps (CE, drafters/drafter/objective.py) on the target's greedy continuations."""
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_llama_target(seed=0, vocab_size=512)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(8)
    target.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (1, 20), generator=g) for _ in range(3)]
    log = agentic_log(root / "agent.jsonl", {f"s{i}": [p[0, :10].tolist(), p[0].tolist()] for i, p in enumerate(prompts)})

    config = build_draft_config(DrafterConfig(num_layers=1, block_size=B, num_target_features=3), target.config, 511)
    drafter = train_on_greedy_continuations(target, prompts, config, NEW, None)
    path = save_drafter(drafter.eval(), root / "trained")
    return root / "target", log, path


def test_trained_drafter_tau_equals_reference(tiny_setup, tmp_path):
    target, log, drafter = tiny_setup
    settings = run_config(target, categories=["agentic"], trajectories=[str(log)], max_prompts=3,
                          max_new_tokens=NEW, reference_subset=3, out=str(tmp_path / "greedy"), warmup=False)
    report = evaluate([f"trained={drafter}"], settings, log=lambda *a, **k: None)
    m = report["categories"]["agentic"]["methods"]["trained"]
    assert m["tau_mean"] > 1.5, m  # non-trivial: it accepts drafted tokens
    assert report["mismatches"] == [] and m["identical"] == 3
    assert report["categories"]["agentic"]["methods"]["trained+lookup"]["identical"] == 3
    ref = m["reference"]
    assert ref["prompts"] == 3 and ref["acceptance_lengths_equal"] == 3
    assert ref["outputs_identical_to_ours"] == ref["outputs_identical_to_target"] == 3
    assert ref["tau_ours"] == ref["tau_reference"] and ref["rel_diff"] == 0.0
    assert m["sim_tau"] > 1.5  # the teacher-forced estimate sees the same skill
    for p in report["prompts"]:
        r = p["results"]["trained"]
        assert r["reference"]["acceptance_lengths"] == r["acceptance_lengths"]
        assert sum(r["acceptance_lengths"]) == r["new_tokens"] - 1

    # Sampled (T > 0): runs every method, reports tau, makes no token-for-token claim.
    settings.eval.temperature, settings.eval.out, settings.eval.reference_subset = 0.8, str(tmp_path / "sampled"), 1
    sampled = evaluate([f"trained={drafter}"], settings, log=lambda *a, **k: None)
    ms = sampled["categories"]["agentic"]["methods"]
    assert ms["trained"]["tau_mean"] > 1.0  # rejection sampling still accepts the trained drafter's tokens
    assert "identical" not in ms["trained"] and sampled["mismatches"] == []
    assert ms["trained"]["reference"]["tau_reference"] > 1.0
    for p in sampled["prompts"]:
        for method in ("trained", "trained+lookup", "prompt_lookup", "target"):
            r = p["results"][method]
            assert sum(r["acceptance_lengths"]) == r["new_tokens"] - 1, method
    assert "T>0" in (tmp_path / "sampled" / "report.md").read_text()


@torch.no_grad()
def test_drafter_with_lookup_switches_and_keeps_the_drafter_whole(tiny_setup):
    """A prompt that repeats itself: lookup drafts the steps whose last 2 tokens recur, the drafter the others
    (told apart by their draft counts, 5 and B - 1), and the drafter, which skips the lookup steps, still reads
    every committed token's features: its cache position check in ``DFlashDrafter.step`` would refuse a gap."""
    target_dir, _, drafter_path = tiny_setup
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_spec(resolve_drafter(str(drafter_path)), torch.float32, target.config)
    g = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, 500, (1, 12), generator=g)
    ids = torch.cat([torch.randint(3, 500, (1, 6), generator=g), phrase, phrase[:, :6]], dim=1)
    alone = target_generate(target, ids, NEW)
    both = generate(drafter, target, ids, NEW, lookup=PromptLookup(num_draft=5), min_match=2)
    assert both.tokens == alone.tokens
    assert sum(both.acceptance_lengths) == len(both.tokens) - 1
    assert B - 1 in both.proposed and any(0 < n <= 5 for n in both.proposed), both.proposed
    drafter_only = generate(drafter, target, ids, NEW)
    assert drafter_only.tokens == alone.tokens


@torch.no_grad()
def test_drafter_with_lookup_lets_the_drafter_choose_between_occurrences(tiny_setup):
    """The context's last 2 tokens recur twice with different continuations: the drafter with lookup drafts the
    continuation that agrees longest with the drafter's own draft on the same features, and decodes exactly."""
    target_dir, _, drafter_path = tiny_setup
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_spec(resolve_drafter(str(drafter_path)), torch.float32, target.config)
    head = FrozenTargetHead.from_model(target)
    g = torch.Generator().manual_seed(7)
    pair, one, two = (torch.randint(3, 500, (1, k), generator=g) for k in (2, 5, 5))
    ids = torch.cat([torch.randint(3, 500, (1, 4), generator=g), pair, one, pair, two, pair], dim=1)
    capture = HFCapture(target, list(drafter.target_layer_ids))
    try:
        features = capture.capture(ids[:, :-1], with_final=False).selected  # the anchor is the last token
    finally:
        capture.remove()
    context = ids[0].numpy()
    alone = DFlashProposer(drafter, head)
    alone.start(features)
    draft = alone.propose(context, 5, 0.0, None).drafts
    both = DrafterWithLookup(DFlashProposer(drafter, head), PromptLookup(num_draft=5), min_match=2)
    both.start(features)
    chosen = both.propose(context, 5, 0.0, None).drafts
    starts = ngram_matches(context, 3, 2)[1]
    assert len(starts) == 2
    assert chosen == agreeing_continuation(context, starts, draft, 5)[0]
    assert chosen in (one[0].tolist(), two[0].tolist())
    decoded = generate(drafter, target, ids, NEW, lookup=PromptLookup(num_draft=5), min_match=2)
    assert decoded.tokens == target_generate(target, ids, NEW).tokens


def test_sharded_bf16_target_decodes_like_one_device(tiny_setup, tmp_path):
    """bf16 target dispatched by a device_map (half its layers paged in from disk, accelerate's hooks): the same
    tokens and acceptance lengths as the whole bf16 target on one device."""
    target, log, drafter = tiny_setup
    base = dict(target=target, categories=["agentic"], trajectories=[str(log)], max_prompts=3, max_new_tokens=NEW,
                reference_subset=0, dtype="bf16", warmup=False)
    whole = evaluate([f"trained={drafter}"], run_config(**base, out=str(tmp_path / "whole")), log=lambda *a, **k: None)
    layers = {f"model.layers.{i}": "cpu" if i < 4 else "disk" for i in range(8)}
    device_map = {"model.embed_tokens": "cpu", **layers, "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    sharded = evaluate([f"trained={drafter}"], run_config(**base, out=str(tmp_path / "sharded"), device_map=device_map),
                       log=lambda *a, **k: None)
    m = sharded["categories"]["agentic"]["methods"]["trained"]
    assert m["tau_mean"] > 1.5 and m["identical"] == 3
    for a, b in zip(whole["prompts"], sharded["prompts"]):
        for method in ("trained", "prompt_lookup", "target"):
            for key in ("acceptance_lengths", "new_tokens", "identical_to_target"):
                assert a["results"][method].get(key) == b["results"][method].get(key), (method, key)
    # The map really dispatched: the disk half of the layers are meta tensors paged in by accelerate's hooks.
    from drafters.target.loading import load_target_model

    model = load_target_model(target, dtype=torch.bfloat16, device_map=device_map, offload_folder=tmp_path / "offload")
    assert {p.device.type for n, p in model.named_parameters() if ".layers.7." in n} == {"meta"}
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
