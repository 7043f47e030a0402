"""Why the drafter does not copy: what the target's layers and the drafter's fused context identify, where slot 1
looks on copyable positions, and whether a perfect lookup would make slot 1 right.

On the eval's held-out code and prose prompts and the target's greedy continuation of each (the sequences of
bench_copy_attention and bench_heldout_tau), four measurements:

1. Linear probes, per state: the input embedding (`emb`, HF hidden_states[0]), the output of every target layer
   `L0` .. `L{L-1}` (id i is the OUTPUT of 0-based layer i, HF hidden_states[i + 1]; the last one is the final-normed
   state, as HFCapture returns it), the drafter's fused context `fused` = drafter.fuse(its target layers), and the
   key (before RoPE) and value that the last draft layer's copy head computes from it (`key_h0`, `value_h0`, 64
   wide). A ridge map from a position j's state to the target's input embedding of a token is fitted on every
   position of --probe-prompts further held-out prompts per category (prompt tokens only, no document that a scored
   prompt comes from) and scored on positions of the scored sequences: top-1 is right when the predicted vector's
   nearest embedding row (cosine, all 49,152 rows) is the probed token. Probed tokens: the token at j (`cur`), at
   j - 1 (`prev`: what the key at j of an induction step needs) and at j + 1 (`next`). `lens` is the logit lens:
   the target's final norm and lm_head on the state (lm_head alone on the final-normed last layer and on `fused`),
   top-1 against the token at j + 1. `majority`: always guessing the most frequent scored token.
2. Slot 1, teacher forced (eval.measures.teacher_forced_slots), on copyable continuation positions a (prompt
   lookup's first token right) and elsewhere; copyable positions split by whether every earlier occurrence of
   token[a] is followed by token[a + 1] (a one-token lookup cannot be misled) or not. The draft attention of
   slot 1 on copyable positions: mass on the sources j (token[j] = token[a], token[j + 1] = token[a + 1]) and on
   j + 1 (the position that holds the token to copy; what the supervised copy head of `train.copy_heads` with
   `copy_query: slot` is taught to look at), per layer, against a uniform spread.
3. Forced lookups (an intervention): slot 1 drafted again with the attention of the copy head (or of every head)
   at slot 1 set to a uniform spread over the positions j + 1: does a perfect lookup make slot 1 right? And the
   OV lens: lm_head(norm gain * o_proj_h(v_proj_h(fused at p))) top-1 against the token at p, per draft head:
   can a head's value path carry the token it would copy?
4. The induction ingredient as an oracle: at copyable positions, the anchor token's embedding (what the block's
   slot 0 holds) scored against every context position p < a by cosine with the raw state (`raw`), with the `cur`
   probe's vector at p (`cur`: key at j) and with the `prev` probe's vector at p (`prev`: key at j + 1, the
   induction form). Reported: how often the best-scoring position holds the anchor token (`hit`), how often the
   token right after it (the token at it, for `prev`) is token[a + 1] (`copy`), and the separation of same-token
   positions from the rest in standard deviations (`sep`). Row `emb`/`raw` is exact token matching: the ceiling of
   a one-token lookup.

    .venv/bin/python -m bench.bench_copy_probe outputs/bench/peers/budget/ours/snapshots/step-000802 --prompts 4

Prints markdown tables and writes results.json and report.md under --out (default outputs/bench/copy_probe), with
the continuations cached there as continuations.pt. One thread by default (--threads): about 4 CPU-minutes with the
defaults, 2 of them the target's greedy continuations, which a rerun reads from the cache.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CATEGORIES = ("code", "prose")
PROBES = ("cur", "prev", "next")


def fit_ridge(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, ...]:
    """Ridge map from standardised x [n, H] to y [n, D], fitted in float64; alpha scales the penalty by n."""
    x, y = x.double(), y.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mu) / sd
    y_mu = y.mean(0)
    gram = z.T @ z + alpha * len(z) * torch.eye(z.shape[1], dtype=z.dtype)
    w = torch.linalg.solve(gram, z.T @ (y - y_mu))
    return mu.float(), sd.float(), w.float(), y_mu.float()


def apply_ridge(probe, x: torch.Tensor) -> torch.Tensor:
    """The fitted map (float32) applied to states x [n, H]."""
    mu, sd, w, y_mu = probe
    return ((x.float() - mu) / sd) @ w + y_mu


def nearest(vectors: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Row index of table (already unit rows, bf16) with the highest cosine to each vector."""
    unit = F.normalize(vectors.float(), dim=-1).to(table.dtype)
    return torch.cat([(unit[i : i + 512] @ table.T).argmax(-1) for i in range(0, len(unit), 512)])


def vocab_logits(weight: torch.Tensor):
    """rows -> logits over the vocabulary rows of weight (bf16 products: this CPU multiplies bf16 fastest)."""
    return lambda rows: rows.to(weight.dtype) @ weight.T


def top1(logits_of, rows: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    return torch.cat([logits_of(rows[i : i + chunk]).argmax(-1) for i in range(0, len(rows), chunk)])


def top_ids(logits_of, rows: torch.Tensor, k: int, chunk: int = 512) -> torch.Tensor:
    """[n, k] the k highest-scoring vocabulary ids of each row, best first."""
    return torch.cat([logits_of(rows[i : i + chunk]).topk(k, -1).indices for i in range(0, len(rows), chunk)])


def one_token_lookup(tokens: torch.Tensor, a: int) -> dict:
    """What a lookup keyed on token[a] alone finds: earlier occurrences j < a and the tokens after them."""
    earlier = (tokens[:a] == tokens[a]).nonzero()[:, 0]
    follow = tokens[earlier + 1]
    want = tokens[a + 1]
    return {"occurrences": len(earlier), "unambiguous": bool(len(earlier)) and bool((follow == want).all()),
            "earliest_right": bool(len(earlier)) and bool(follow[0] == want),
            "latest_right": bool(len(earlier)) and bool(follow[-1] == want)}


@torch.inference_mode()
def block_forward(drafter, embed, context_kv, tokens: torch.Tensor, a: int, forces: list[dict | None] = (None,)):
    """The block anchored at a, drafted alone over context < a (as bench_copy_attention's block_attention), with
    the attention probabilities kept; one batch row per entry of forces. A force {layer: (heads, slot, positions)}
    sets the attention of those heads at that slot to a uniform spread over those context positions. Returns
    (normed hidden [variants, B, H], per-layer [variants, heads, B, a] attention over the context)."""
    from drafters.drafter.model import apply_rope

    b, n = drafter.block_size, len(forces)
    ids = torch.tensor([[int(tokens[a])] + [drafter.mask_token_id] * (b - 1)]).expand(n, -1)
    x = embed(ids).to(context_kv[0][0].dtype)
    rope = drafter._rope(x, torch.arange(a, a + b)[None].expand(n, -1))
    probs_out = []
    for index, (layer, (k_all, v_all)) in enumerate(zip(drafter.layers, context_kv)):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn._heads(attn.q_proj(h), attn.n_heads)).transpose(1, 2), *rope)
        k_block, v_block = attn.keys_values(h, rope)
        repeat = attn.n_heads // attn.n_kv_heads
        k = torch.cat([k_all[:, :, :a].expand(n, -1, -1, -1), k_block], 2).repeat_interleave(repeat, 1)
        v = torch.cat([v_all[:, :, :a].expand(n, -1, -1, -1), v_block], 2).repeat_interleave(repeat, 1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim), -1)
        probs_out.append(probs[:, :, :, :a])
        if any(force and index in force for force in forces):
            probs = probs.clone()
            for row, force in enumerate(forces):
                if force and index in force:
                    heads, slot, positions = force[index]
                    spread = torch.zeros(probs.shape[-1], dtype=probs.dtype)
                    spread[positions] = 1.0 / len(positions)
                    probs[row, heads, slot] = spread
        x = x + attn.o_proj((probs @ v).transpose(1, 2).flatten(2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x), probs_out


def ov_lens(drafter, head, fused: torch.Tensor, tokens: torch.Tensor) -> list[list[dict]]:
    """Per draft layer and head: lm_head(norm gain * o_proj_h(v_proj_h(fused_p))) top-1 and top-10 against token p:
    the direct path of a head that attends only to p (the MLP and the other heads left out)."""
    out = []
    weight = head.lm_head.weight.to(torch.bfloat16)
    for layer in drafter.layers:
        attn = layer.self_attn
        d, repeat = attn.head_dim, attn.n_heads // attn.n_kv_heads
        values = attn.v_proj(fused).view(len(fused), attn.n_kv_heads, d)
        rows = []
        for h in range(attn.n_heads):
            # What the head writes into the residual, through the draft norm's gain (its scale does not change ranks).
            written = (values[:, h // repeat] @ attn.o_proj.weight[:, h * d : (h + 1) * d].T) * drafter.norm.weight
            ranked = top_ids(vocab_logits(weight), written, 10)
            rows.append({"top1": float((ranked[:, 0] == tokens).float().mean()),
                         "top10": float((ranked == tokens[:, None]).any(-1).float().mean())})
        out.append(rows)
    return out


def slot1_outcome(logits: torch.Tensor, wanted: torch.Tensor) -> tuple[bool, float, int]:
    """(right, log-probability of the wanted token, its rank: 0 = top-1) of one slot's logits."""
    return (bool(logits.argmax() == wanted), float(torch.log_softmax(logits.float(), -1)[wanted]),
            int((logits > logits[wanted]).sum()))


def fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def main(argv=None) -> None:
    from bench.bench_copy_attention import context_keys_values, copy_sources
    from bench.bench_heldout_tau import continuations
    from bench.bench_learning_curve import lookup_hits
    from common.atomic_files import write_json_atomic
    from drafters.drafter.checkpoint import find_drafter_folder, load_drafter
    from drafters.target.capture import HFCapture, decoder_of
    from drafters.target.frozen import FrozenTargetHead
    from drafters.target.loading import load_target_model, load_target_tokenizer
    from drafters.target.testbed import testbed_target_dir
    from eval.measures import teacher_forced_slots
    from eval.traces import heldout_traces

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="serving-format drafter folder (or a training checkpoint / output_dir)")
    parser.add_argument("--target", default=None, help="target folder (default: the testbed target)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per category, with continuations")
    parser.add_argument("--probe-prompts", type=int, default=12,
                        help="further held-out prompts per category (prompt tokens only) that the probes are fitted on")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--test-rows", type=int, default=256, help="probe positions scored per category")
    parser.add_argument("--ov-rows", type=int, default=256, help="positions per category for the OV lens")
    parser.add_argument("--alpha", type=float, default=0.01, help="ridge penalty (times the row count)")
    parser.add_argument("--copy-head", type=int, default=0, help="last-layer head taught the offset-1 lookup")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="outputs/bench/copy_probe")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = round(time.perf_counter() - started - sum(timings.values()), 1)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = Path(args.target) if args.target else testbed_target_dir()
    model = load_target_model(target, dtype=torch.float32)
    tokenizer = load_target_tokenizer(target)
    head = FrozenTargetHead.from_pretrained(target, dtype=torch.float32)
    final_norm = decoder_of(model).norm
    drafter = load_drafter(find_drafter_folder(args.drafter), dtype=torch.float32).eval()
    num_layers = len(decoder_of(model).layers)
    hidden = head.hidden_size
    last = len(drafter.layers) - 1
    copy_attn = drafter.layers[last].self_attn
    n_heads = copy_attn.n_heads
    copy_kv_head = args.copy_head // (n_heads // copy_attn.n_kv_heads)

    cache = out / "continuations.pt"
    key = {"target": str(target.resolve()), "prompts": args.prompts, "new_tokens": args.new_tokens}
    traces = torch.load(cache, weights_only=True) if cache.exists() else None
    if traces is None or traces["key"] != key:
        traces = {"key": key, "categories": continuations(model, tokenizer, args.prompts, args.new_tokens, CATEGORIES)}
        torch.save(traces, cache)
    lap("continuations")

    # The probes' own data: the next held-out prompts of each category, from documents no scored prompt comes from.
    probe_rows: list[tuple[str, torch.Tensor]] = []
    skipped_same_document = 0
    for category in CATEGORIES:
        listed = heldout_traces(category, tokenizer, max_prompts=args.prompts + args.probe_prompts,
                                max_new_tokens=args.new_tokens).traces
        scored_docs = {t.meta.get("document_id") for t in listed[: args.prompts]}
        for trace in listed[args.prompts:]:
            if trace.meta.get("document_id") in scored_docs:
                skipped_same_document += 1
                continue
            probe_rows.append((category, torch.tensor([trace.input_ids])))

    # Every state of every sequence: emb, L0 .. L{L-1}, fused, and the copy head's key and value (no RoPE).
    layer_states = ["emb"] + [f"L{i}" for i in range(num_layers)] + ["fused"]
    head_states = [f"key_h{args.copy_head}", f"value_h{args.copy_head}"]
    states = layer_states + head_states
    capture = HFCapture(model, list(range(num_layers)))

    @torch.inference_mode()
    def all_states(sequence: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tokens = sequence[0]
        layers = capture.capture(sequence, with_final=False).selected[0].view(len(tokens), num_layers, hidden)
        record = {"emb": head.embed(tokens)}
        record.update({f"L{i}": layers[:, i].clone() for i in range(num_layers)})
        features = torch.cat([layers[:, i] for i in drafter.target_layer_ids], -1)[None]
        fused = drafter.fuse(features)
        record["fused"] = fused[0]
        record[head_states[0]] = copy_attn.k_norm(copy_attn._heads(copy_attn.k_proj(fused), copy_attn.n_kv_heads))[0, :, copy_kv_head]
        record[head_states[1]] = copy_attn._heads(copy_attn.v_proj(fused), copy_attn.n_kv_heads)[0, :, copy_kv_head]
        return record, features

    seqs = []
    for category in CATEGORIES:
        for sequence, n_prompt in traces["categories"][category]:
            record, features = all_states(sequence)
            seqs.append({"category": category, "tokens": sequence[0], "n_prompt": n_prompt, "states": record,
                         "features": features})
    probe_seqs = [{"category": c, "tokens": ids[0], "states": all_states(ids)[0]} for c, ids in probe_rows]
    capture.remove()
    lap("capture")

    # Scored probe positions: j in 1 .. T-2 of the scored sequences (prompt and continuation), sampled per category.
    gen = torch.Generator().manual_seed(args.seed)
    test_pos: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for category in CATEGORIES:
        pairs = [(i, j) for i, s in enumerate(seqs) if s["category"] == category for j in range(1, len(s["tokens"]) - 1)]
        chosen: dict[int, list[int]] = {}
        for p in torch.randperm(len(pairs), generator=gen)[: args.test_rows].tolist():
            chosen.setdefault(pairs[p][0], []).append(pairs[p][1])
        test_pos[category] = [(i, torch.tensor(sorted(js))) for i, js in sorted(chosen.items())]

    def probed(tokens: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"cur": tokens[positions], "prev": tokens[positions - 1], "next": tokens[positions + 1]}

    table = F.normalize(head.embed_tokens.weight, dim=-1).to(torch.bfloat16)
    lm_weight = head.lm_head.weight.to(torch.bfloat16)
    majority = {}
    for category in CATEGORIES:
        wanted = {p: torch.cat([probed(seqs[i]["tokens"], js)[p] for i, js in test_pos[category]]) for p in PROBES}
        majority[category] = {p: float(w.bincount().max() / len(w)) for p, w in wanted.items()}

    # Copyable continuation anchors of every scored sequence (parts 2-4).
    for s in seqs:
        tokens, n_prompt = s["tokens"], s["n_prompt"]
        s["anchors"] = list(range(n_prompt, len(tokens) - 1))
        s["copyable"] = lookup_hits(tokens[None], n_prompt)
        s["copy_anchors"] = [a for a, hit in zip(s["anchors"], s["copyable"].tolist())
                             if hit and copy_sources(tokens, a).any()]

    probe_results: dict[str, dict] = {}
    oracle_results: dict[str, dict] = {}
    with torch.inference_mode():
        for state in states:
            x = torch.cat([s["states"][state][1:-1] for s in probe_seqs])
            y = torch.cat([torch.cat([head.embed(s["tokens"][1:-1]), head.embed(s["tokens"][:-2]),
                                      head.embed(s["tokens"][2:])], -1) for s in probe_seqs])
            probe = fit_ridge(x, y, args.alpha)
            probe_results[state] = {}
            for category in CATEGORIES:
                correct = {p: [] for p in (*PROBES, "lens")}
                for i, js in test_pos[category]:
                    s = seqs[i]
                    rows = s["states"][state][js]
                    predicted = apply_ridge(probe, rows).view(len(js), len(PROBES), hidden)
                    wanted = probed(s["tokens"], js)
                    for k, p in enumerate(PROBES):
                        correct[p].append(nearest(predicted[:, k], table) == wanted[p])
                    if state in layer_states[1:]:
                        normed = rows if state in ("fused", f"L{num_layers - 1}") else final_norm(rows)
                        correct["lens"].append(top1(vocab_logits(lm_weight), normed) == wanted["next"])
                probe_results[state][category] = {p: float(torch.cat(v).float().mean()) if v else None
                                                  for p, v in correct.items()}
            # Part 4: the anchor token's embedding against every context position's state.
            found = {c: {m: {"hit": [], "copy": [], "sep": []} for m in ("raw", "cur", "prev")} for c in CATEGORIES}
            for s in seqs:
                if not s["copy_anchors"]:
                    continue
                tokens, raw = s["tokens"], s["states"][state]
                mapped = apply_ridge(probe, raw).view(len(tokens), len(PROBES), hidden)
                anchors = torch.tensor(s["copy_anchors"])
                query = F.normalize(head.embed(tokens[anchors]), dim=-1)
                methods = [("cur", mapped[:, 0], 0), ("prev", mapped[:, 1], 1)]
                if raw.shape[-1] == hidden:
                    methods.insert(0, ("raw", raw, 0))
                for method, keys, shift in methods:
                    scores = query @ F.normalize(keys, dim=-1).T  # [n_anchors, T]
                    positions = torch.arange(len(tokens))
                    visible = (positions[None] < anchors[:, None]) & (positions[None] >= shift)
                    best = scores.masked_fill(~visible, float("-inf")).argmax(-1)
                    key_token = tokens[(positions - shift).clamp_min(0)]
                    match = (key_token[None] == tokens[anchors][:, None]) & visible
                    found[s["category"]][method]["hit"].append(match.gather(1, best[:, None])[:, 0])
                    found[s["category"]][method]["copy"].append(tokens[best + 1 - shift] == tokens[anchors + 1])
                    # Separation: (mean score on same-token positions - mean on the others) / std of the others.
                    other = visible & ~match
                    n_same, n_other = match.sum(-1), other.sum(-1)
                    same_mean = (scores * match).sum(-1) / n_same.clamp_min(1)
                    other_mean = (scores * other).sum(-1) / n_other.clamp_min(1)
                    other_var = (((scores - other_mean[:, None]) ** 2) * other).sum(-1) / (n_other - 1).clamp_min(1)
                    ok = (n_same > 0) & (n_other > 1)
                    found[s["category"]][method]["sep"].extend(
                        ((same_mean - other_mean) / other_var.sqrt().clamp_min(1e-6))[ok].tolist())
            oracle_results[state] = {
                c: {m: {"hit": float(torch.cat(v["hit"]).float().mean()) if v["hit"] else None,
                        "copy": float(torch.cat(v["copy"]).float().mean()) if v["copy"] else None,
                        "sep": mean(v["sep"])} for m, v in found[c].items()} for c in CATEGORIES}
    lap("probes")

    # Parts 2 and 3: slot 1 teacher forced, attention on copyable positions, forced lookups, the OV lens.
    drafter_results: dict[str, dict] = {}
    detail = {"teacher_forced": 0.0, "block_forwards": 0.0, "ov_lens": 0.0}  # seconds inside "drafter"
    with torch.inference_mode():
        for category in CATEGORIES:
            slot1, copyable, unamb, earliest, latest = [], [], [], [], []
            attn_sums = [{"src": torch.zeros(n_heads), "next": torch.zeros(n_heads), "uniform": 0.0,
                          "last": torch.zeros(n_heads)} for _ in drafter.layers]
            n_attn = 0
            forced = {"alone": [], "copy_head": [], "all_heads_last": []}
            head_found, agree, ov_positions = [], [], []
            for s in (s for s in seqs if s["category"] == category):
                tokens, n_prompt = s["tokens"], s["n_prompt"]
                tick = time.perf_counter()
                slots = teacher_forced_slots(drafter, head, s["features"], tokens[None], n_prompt)
                detail["teacher_forced"] += time.perf_counter() - tick
                if slots is None:
                    continue
                right = slots[0][:, 0]
                slot1.append(right)
                copyable.append(s["copyable"])
                lookups = [one_token_lookup(tokens, a) for a in s["anchors"]]
                unamb.append(torch.tensor([lk["unambiguous"] for lk in lookups]))
                earliest.append(torch.tensor([lk["earliest_right"] for lk in lookups]))
                latest.append(torch.tensor([lk["latest_right"] for lk in lookups]))
                ov_positions += [(s, p) for p in range(1, len(tokens) - 1)]
                tick = time.perf_counter()
                context_kv = context_keys_values(drafter, s["features"])
                for a in s["copy_anchors"]:
                    sources = copy_sources(tokens, a)
                    after = torch.cat([torch.zeros(1, dtype=torch.bool), sources[:-1]])  # j + 1, inside the context
                    targets = after.nonzero()[:, 0]
                    variants = {"alone": None}
                    if len(targets):
                        variants["copy_head"] = {last: ([args.copy_head], 1, targets)}
                        variants["all_heads_last"] = {last: (list(range(n_heads)), 1, targets)}
                    hidden_v, probs_v = block_forward(drafter, head.embed, context_kv, tokens, a, list(variants.values()))
                    logits = head.logits(hidden_v[:, 1])
                    agree.append(bool(logits[0].argmax() == tokens[a + 1]) == bool(right[a - n_prompt]))
                    n_attn += 1
                    for layer, p in enumerate(probs_v):
                        p = p[0]  # the block as trained
                        attn_sums[layer]["src"] += p[:, 1][:, sources].sum(-1)
                        attn_sums[layer]["next"] += p[:, 1][:, after].sum(-1)
                        attn_sums[layer]["last"] += p[:, 1, -1]
                        attn_sums[layer]["uniform"] += float(sources.float().mean())
                    if not len(targets):
                        continue
                    head_found.append(bool(after[probs_v[last][0, args.copy_head, 1].argmax()]))
                    for row, name in enumerate(variants):
                        forced[name].append(slot1_outcome(logits[row], tokens[a + 1]))
                detail["block_forwards"] += time.perf_counter() - tick
            slot1, copyable = torch.cat(slot1), torch.cat(copyable)
            unamb, earliest, latest = torch.cat(unamb), torch.cat(earliest), torch.cat(latest)

            def acc(mask: torch.Tensor, right: torch.Tensor = slot1) -> float | None:
                return float(right[mask].float().mean()) if mask.any() else None

            tick = time.perf_counter()
            pick = torch.randperm(len(ov_positions), generator=gen)[: args.ov_rows].tolist()
            fused_rows = torch.stack([ov_positions[i][0]["states"]["fused"][ov_positions[i][1]] for i in pick])
            token_rows = torch.stack([ov_positions[i][0]["tokens"][ov_positions[i][1]] for i in pick])
            lens_rows = ov_lens(drafter, head, fused_rows, token_rows)
            detail["ov_lens"] += time.perf_counter() - tick
            hf = torch.tensor(head_found, dtype=torch.bool)
            alone = torch.tensor([o[0] for o in forced["alone"]], dtype=torch.bool)
            drafter_results[category] = {
                "anchors": len(slot1), "copyable": int(copyable.sum()), "copyable_share": float(copyable.float().mean()),
                "slot1_all": acc(torch.ones_like(copyable)), "slot1_copyable": acc(copyable),
                "slot1_other": acc(~copyable), "copyable_unambiguous": int((copyable & unamb).sum()),
                "slot1_copyable_unambiguous": acc(copyable & unamb), "slot1_copyable_ambiguous": acc(copyable & ~unamb),
                "one_token_lookup_earliest_on_copyable": float(earliest[copyable].float().mean()),
                "one_token_lookup_latest_on_copyable": float(latest[copyable].float().mean()),
                "one_token_lookup_earliest_on_other": float(earliest[~copyable].float().mean()),
                "attention_anchors": n_attn,
                "block_forward_agrees_with_teacher_forced": mean(agree),
                "attention_slot1": [{k: (v / max(n_attn, 1)).tolist() if torch.is_tensor(v) else v / max(n_attn, 1)
                                     for k, v in sums.items()} for sums in attn_sums],
                "copy_head_argmax_on_j_plus_1": mean(head_found),
                "slot1_when_copy_head_finds_it": float(alone[hf].float().mean()) if hf.any() else None,
                "slot1_when_it_does_not": float(alone[~hf].float().mean()) if (~hf).any() else None,
                "forced_lookup": {k: {"slot1": mean(o[0] for o in v), "logprob": mean(o[1] for o in v),
                                      "median_rank": float(torch.tensor([o[2] for o in v]).float().median()) if v else None}
                                  for k, v in forced.items()},
                "forced_anchors": len(forced["alone"]),
                "ov_lens": lens_rows,
            }
    lap("drafter")
    timings.update({f"drafter: {k}": round(v, 1) for k, v in detail.items()})

    lines = render(args, states, probe_results, majority, oracle_results, drafter_results, drafter, timings)
    report = "\n".join(lines)
    print(report)
    (out / "report.md").write_text(report + "\n")
    write_json_atomic(out / "results.json", {
        "args": vars(args), "target": str(target), "drafter_layers": list(drafter.target_layer_ids),
        "sequences": {c: [[len(s["tokens"]), s["n_prompt"]] for s in seqs if s["category"] == c] for c in CATEGORIES},
        "probe_training": {"prompts": len(probe_seqs), "positions": sum(len(s["tokens"]) - 2 for s in probe_seqs),
                           "skipped_same_document": skipped_same_document},
        "probes": probe_results, "majority": majority, "oracle": oracle_results, "drafter": drafter_results,
        "timings_s": timings})


def render(args, states, probes, majority, oracle, drafter_results, drafter, timings) -> list[str]:
    marked = {f"L{i}" for i in drafter.target_layer_ids}

    def name(state: str) -> str:
        return state + ("*" if state in marked else "")

    lines = ["## 1. Linear probes: top-1 of the token at j (cur), j-1 (prev), j+1 (next); logit lens against j+1",
             "", (f"`*`: a layer the drafter injects. {args.test_rows} scored positions per category; "
             f"key_h{args.copy_head} / value_h{args.copy_head}: the drafter's last-layer copy head's key (no RoPE) and "
             "value of the fused context (64 wide)."), ""]
    lines.append("| state | " + " | ".join(f"{c} {p}" for c in CATEGORIES for p in (*PROBES, "lens")) + " |")
    lines.append("|---|" + "---:|" * (4 * len(CATEGORIES)))
    for state in states:
        lines.append(f"| {name(state)} | " + " | ".join(fmt(probes[state][c][p]) for c in CATEGORIES
                                                         for p in (*PROBES, "lens")) + " |")
    lines.append("| majority | " + " | ".join(fmt(majority[c]["next" if p == "lens" else p])
                                              for c in CATEGORIES for p in (*PROBES, "lens")) + " |")

    lines += ["", "## 2. Slot 1, teacher forced, at continuation anchors", "",
              ("| category | anchors | copyable | slot-1 all | copyable | other | copyable, one-token lookup unambiguous "
              "(n) | copyable, ambiguous | one-token lookup right on copyable (earliest / latest) | on other (earliest) |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c, r in drafter_results.items():
        lines.append(f"| {c} | {r['anchors']} | {r['copyable']} ({r['copyable_share']:.2f}) | {fmt(r['slot1_all'])} "
                     f"| {fmt(r['slot1_copyable'])} | {fmt(r['slot1_other'])} | {fmt(r['slot1_copyable_unambiguous'])} "
                     f"({r['copyable_unambiguous']}) | {fmt(r['slot1_copyable_ambiguous'])} "
                     f"| {fmt(r['one_token_lookup_earliest_on_copyable'])} / {fmt(r['one_token_lookup_latest_on_copyable'])} "
                     f"| {fmt(r['one_token_lookup_earliest_on_other'])} |")

    lines += ["", (f"Slot-1 attention at copyable anchors, mass over the context (head {args.copy_head} of the last layer "
              "is the one taught the offset-1 lookup, on j+1, when trained with copy heads, copy_query slot):"), "",
              ("| category | layer | on sources j, mean head | on j+1, mean head | on j+1, best head (which) "
              f"| on j+1, head {args.copy_head} | uniform on j | on the last context position, mean head |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c, r in drafter_results.items():
        for layer, a in enumerate(r["attention_slot1"]):
            nxt = torch.tensor(a["next"])
            lines.append(f"| {c} | {layer + 1} | {fmt(mean(a['src']))} | {fmt(float(nxt.mean()))} "
                         f"| {fmt(float(nxt.max()))} ({int(nxt.argmax())}) | {fmt(a['next'][args.copy_head])} "
                         f"| {fmt(a['uniform'])} | {fmt(mean(a['last']))} |")

    lines += ["", "## 3. Would a perfect lookup copy? Slot-1 accuracy at copyable anchors whose j+1 is in the context", "",
              (f"| category | anchors | head {args.copy_head}'s argmax on a j+1 (slot-1 when it is / is not) "
               "| as trained: slot-1 / log p / median rank of the token to copy "
               f"| forced: head {args.copy_head} of the last layer on the j+1 | every head of the last layer "
               "| check: block forward = teacher forced |"), "|---|---:|---:|---:|---:|---:|---:|"]

    def outcome(o: dict) -> str:
        return f"{fmt(o['slot1'])} / {fmt(o['logprob'], 2)} / {fmt(o['median_rank'], 0)}"

    for c, r in drafter_results.items():
        f = r["forced_lookup"]
        lines.append(f"| {c} | {r['forced_anchors']} | {fmt(r['copy_head_argmax_on_j_plus_1'])} "
                     f"({fmt(r['slot1_when_copy_head_finds_it'])} / {fmt(r['slot1_when_it_does_not'])}) "
                     f"| {outcome(f['alone'])} | {outcome(f['copy_head'])} | {outcome(f['all_heads_last'])} "
                     f"| {fmt(r['block_forward_agrees_with_teacher_forced'])} |")
    lines += ["", (f"OV lens: lm_head(norm gain * o_proj_h v_proj_h(fused at p)), top-1 / top-10 against the token at p ({args.ov_rows} "
              "positions per category):"), "", f"| category | layer | mean head | best head (which) | head {args.copy_head} |",
              "|---|---:|---:|---:|---:|"]
    for c, r in drafter_results.items():
        for layer, rows in enumerate(r["ov_lens"]):
            t1 = torch.tensor([h["top1"] for h in rows])
            t10 = torch.tensor([h["top10"] for h in rows])
            lines.append(f"| {c} | {layer + 1} | {float(t1.mean()):.3f} / {float(t10.mean()):.3f} "
                         f"| {float(t1.max()):.3f} / {float(t10.max()):.3f} ({int(t1.argmax())}) "
                         f"| {rows[args.copy_head]['top1']:.3f} / {rows[args.copy_head]['top10']:.3f} |")

    lines += ["", ("## 4. Oracle content match at copyable anchors: the anchor token's embedding against each context "
              "position's state"), "", ("hit: the best-scoring position holds the anchor token (for prev: follows it); "
              "copy: the token after it (at it, for prev) is the token to draft; sep: same-token positions against the "
              "rest, in standard deviations of the rest."), "",
              "| state | " + " | ".join(f"{c} {m} hit / copy / sep" for c in CATEGORIES for m in ("raw", "cur", "prev"))
              + " |", "|---|" + "---:|" * (3 * len(CATEGORIES))]
    for state in states:
        cells = []
        for c in CATEGORIES:
            for m in ("raw", "cur", "prev"):
                o = oracle[state][c].get(m)
                cells.append("-" if o is None else f"{fmt(o['hit'], 2)} / {fmt(o['copy'], 2)} / {fmt(o['sep'], 1)}")
        lines.append(f"| {name(state)} | " + " | ".join(cells) + " |")
    total = sum(v for k, v in timings.items() if not k.startswith("drafter:"))
    lines += ["", f"Timings (s, {args.threads} thread(s)): {timings}, total {total:.1f}"]
    return lines


if __name__ == "__main__":
    main()
