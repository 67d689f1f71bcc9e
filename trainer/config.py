"""The trainer's one typed config (`agentrl train` flags, ``AGENTRL_TRAINER_*`` env, YAML), validated at start.

Bad combinations are refused before any model is loaded, with a message that says how to fix them. Checks
that need data (a row longer than the micro-batch token budget) run again when a batch arrives
(:func:`check_row_fits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from agentrl import defaults
from agentrl.settings import SettingsError
from trainer.core_algos import ADV_ESTIMATORS, LOSS_AGG_MODES
from trainer.engine_ops import ENGINE_KINDS

SYNC_MODES: tuple[str, ...] = ("disk", "broadcast", "tensor", "none")
# --release-memory: what the engines give back during each train step (SGLang's memory tags)
RELEASE_MEMORY: dict[str, list[str]] = {"none": [], "kv_cache": ["kv_cache"],
                                        "all": ["kv_cache", "weights", "cuda_graph"]}
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def _h(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass
class TrainerSettings:
    env_prefix: ClassVar[str] = "AGENTRL_TRAINER_"

    # where data comes from and weights go
    gateway: str = field(default="", metadata=_h("gateway base URL, e.g. http://127.0.0.1:8000 (leases, admin API)"))
    admin_key: str = field(default="", metadata=_h("the gateway's admin key (sent as Bearer)"))
    model: str = field(default="smollm2", metadata=_h("smollm2, tiny or a Hugging Face model directory; the engines must serve the same model"))
    engine_urls: list[str] = field(default_factory=list, metadata=_h("engine base URLs to push weights to; default: asked from the gateway (GET /admin/engines)"))
    engine_kind: str = field(default="auto", metadata=_h("engine protocol for weight pushes: sglang (SGLang, embedded engine), vllm (VLLM_SERVER_DEV_MODE=1), auto (detected per engine)", choices=ENGINE_KINDS))

    # optimisation
    lr: float = field(default=defaults.LR, metadata=_h("AdamW learning rate"))
    weight_decay: float = field(default=0.0, metadata=_h("AdamW weight decay"))
    max_grad_norm: float = field(default=1.0, metadata=_h("gradient clipping by global norm (0 = off)"))
    steps: int = field(default=0, metadata=_h("optimizer steps to run now, counted from where a resumed run starts (0 = run until stopped)"))
    group_size: int = field(default=defaults.GROUP_SIZE, metadata=_h("sessions per GRPO group the agents produce (>= 2: GRPO compares sessions within a group); told to the gateway for its admission budget"))
    batch_groups: int = field(default=defaults.BATCH_GROUPS, metadata=_h("batch size in groups: how many finished groups one step trains on"))
    mini_batches: int = field(default=1, metadata=_h("optimizer steps per leased batch (the batch is split by group)"))
    micro_batch_tokens: int = field(default=8192, metadata=_h("token budget of one forward/backward pass (rows x padded length); must hold the longest row"))
    max_seq_len: int = field(default=0, metadata=_h("longest row the agents can produce, if known (checked against micro_batch_tokens at start; 0 = check per batch only)"))
    packing: bool = field(default=True, metadata=_h("pack each micro-batch's rows without padding (attention kept inside each row) and compute logprobs only at loss positions, in chunks; off = the padded full-logits path"))
    compile: bool = field(default=False, metadata=_h("torch.compile the decoder layers (one rank: whole layers; several: their attention, MLPs and norms; pays on GPUs; the first steps compile)"))
    adv_estimator: str = field(default="grpo", metadata=_h("advantage estimator", choices=ADV_ESTIMATORS))
    loss_agg_mode: str = field(default="token-mean", metadata=_h("loss aggregation", choices=LOSS_AGG_MODES))
    clip_low: float = field(default=0.2, metadata=_h("PPO ratio clipped below at 1 - clip_low"))
    clip_high: float = field(default=0.28, metadata=_h("PPO ratio clipped above at 1 + clip_high"))
    is_cap: float = field(default=5.0, metadata=_h("behaviour importance weight cap: tokens with exp(prox - behaviour) above it are masked (0 = no cap)"))
    gamma: float = field(default=-1.0, metadata=_h("discount along each root-to-leaf path to recompute a row's return from its raw turn rewards; -1 = use the reward the gateway exported"))
    staleness_bound: int = field(default=defaults.STALENESS_BOUND, metadata=_h("k: the gateway leases rows at most k versions older than the trainer, and admits sessions accordingly"))

    # LoRA (docs/lora.md): train a peft adapter on the frozen base instead of every weight; pushes send the adapter
    lora_rank: int = field(default=0, metadata=_h("train a LoRA adapter of this rank on the frozen base model (0 = full fine-tuning); only the adapter gets gradients and optimizer state, and only it is pushed and checkpointed (peft's layout)"))
    lora_alpha: float = field(default=32.0, metadata=_h("LoRA scaling numerator: the adapter adds lora_alpha / lora_rank x B A x"))
    lora_targets: list[str] = field(default_factory=lambda: ["all-linear"], metadata=_h("comma-separated module names to adapt (e.g. q_proj,v_proj), or all-linear (every linear layer of the decoder, not the LM head)"))
    lora_name: str = field(default="policy", metadata=_h("the adapter's name on the engines (/load_lora_adapter lora_name; requests name it as lora_path)"))

    # weights out
    sync_mode: str = field(default="disk", metadata=_h("how weights reach the engines: disk (save + /update_weights_from_disk), broadcast (/update_weights_from_distributed over a process group), tensor (/update_weights_from_tensor: CUDA IPC handles, engines on the trainer's GPU), none", choices=SYNC_MODES))
    release_memory: str = field(default="none", metadata=_h("engines sharing the trainer's GPU: during each train step generation is paused and the engines free this memory (SGLang's /release_memory_occupation): none, kv_cache, or all (KV cache and weights); taken back before the weight push", choices=tuple(RELEASE_MEMORY)))
    sync_dir: str = field(default="", metadata=_h("disk mode: directory the engines can read; default <checkpoint_dir>/sync"))
    sync_retries: int = field(default=3, metadata=_h("attempts per weight push before the trainer stops with an error"))
    sync_bucket_mb: float = field(default=256.0, metadata=_h("broadcast mode: tensors are sent in buckets of about this many MB"))
    sync_master_addr: str = field(default="127.0.0.1", metadata=_h("broadcast mode: address of the trainer's rank 0 as the engines reach it"))
    sync_master_port: int = field(default=0, metadata=_h("broadcast mode: port for the weight-update group (0 = a free port)"))

    # state
    checkpoint_dir: str = field(default="runs/trainer", metadata=_h("checkpoints (HF format + optimizer/trainer state) and the metrics file go here"))
    save_every: int = field(default=0, metadata=_h("checkpoint every N steps (0 = only at the end)"))
    keep_checkpoints: int = field(default=defaults.KEEP_CHECKPOINTS, metadata=_h("keep only the newest K checkpoints (0 = keep every one)"))
    save_optimizer: bool = field(default=True, metadata=_h("checkpoints hold the optimizer state (about twice the weights' size), so a resumed run continues exactly; --no-save-optimizer: weights and trainer state only (a resume then starts a fresh optimizer)"))
    resume: bool = field(default=True, metadata=_h("resume from the newest checkpoint in checkpoint_dir (continues the version count)"))
    lease_wait_s: float = field(default=30.0, metadata=_h("long-poll wait for a batch of finished groups"))
    max_idle_s: float = field(default=0.0, metadata=_h("stop when no data arrived for this long (0 = wait forever)"))
    outage_give_up_s: float = field(default=1800.0, metadata=_h("a gateway or engine that is down (connection errors, 502/503/504) is waited for with a bounded back-off, logged once per outage; the trainer stops with an error only after it stayed down this long"))
    device: str = field(default="auto", metadata=_h("auto (cuda if available), cpu or cuda", choices=DEVICES))
    dtype: str = field(default="float32", metadata=_h("compute dtype (parameters and optimizer state stay float32; bfloat16 = FSDP2 mixed precision with several ranks, bf16 compute weights kept beside the float32 ones with one)", choices=DTYPES))
    seed: int = field(default=0, metadata=_h("random seed"))

    def validate(self) -> None:
        """Reject impossible combinations with a message that says how to fix them."""
        if self.group_size < 2:
            raise SettingsError(
                f"group_size={self.group_size}: GRPO normalises each session's reward against the other sessions "
                "of its group, so a group of one has zero advantage and nothing is learned. Run each task at "
                "least twice (--group-size 2 or more, and the same in the agent runner)."
            )
        if self.batch_groups < 1:
            raise SettingsError(f"batch_groups={self.batch_groups}: a step needs at least one group (--batch-groups 1 or more)")
        if self.mini_batches < 1 or self.mini_batches > self.batch_groups:
            raise SettingsError(
                f"mini_batches={self.mini_batches}: each optimizer step needs at least one group, so use "
                f"1 <= --mini-batches <= --batch-groups ({self.batch_groups})"
            )
        if self.micro_batch_tokens < 1:
            raise SettingsError(f"micro_batch_tokens={self.micro_batch_tokens}: set --micro-batch-tokens to a positive token count")
        if self.max_seq_len and self.micro_batch_tokens < self.max_seq_len:
            raise SettingsError(
                f"micro_batch_tokens={self.micro_batch_tokens} is smaller than one sequence (max_seq_len="
                f"{self.max_seq_len}); a row is never split, so raise --micro-batch-tokens to at least "
                f"{self.max_seq_len} or lower the agents' max tokens"
            )
        for name in ("sync_mode", "adv_estimator", "loss_agg_mode", "device", "dtype", "engine_kind", "release_memory"):
            valid = {"sync_mode": SYNC_MODES, "adv_estimator": ADV_ESTIMATORS, "loss_agg_mode": LOSS_AGG_MODES,
                     "device": DEVICES, "dtype": DTYPES, "engine_kind": ENGINE_KINDS,
                     "release_memory": tuple(RELEASE_MEMORY)}[name]
            if getattr(self, name) not in valid:
                raise SettingsError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(valid)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SettingsError(f"lr={self.lr}: the learning rate must be a positive number, e.g. --lr 1e-6")
        if not (0 < self.clip_low < 1) or self.clip_high <= 0:
            raise SettingsError(
                f"clip range [1-{self.clip_low}, 1+{self.clip_high}] is empty or negative: use 0 < clip_low < 1 "
                "and clip_high > 0 (typical: 0.2 and 0.28)"
            )
        if self.is_cap != 0 and self.is_cap <= 1:
            raise SettingsError(f"is_cap={self.is_cap}: a cap at or below 1 masks most on-policy tokens; use 0 (off) or a value > 1, e.g. 5")
        if self.gamma != -1.0 and not (0.0 <= self.gamma <= 1.0):
            raise SettingsError(f"gamma={self.gamma}: use a discount within [0, 1], or -1 to keep the exported rewards")
        if self.staleness_bound < 0:
            raise SettingsError(f"staleness_bound={self.staleness_bound}: use 0 (strictly on-policy) or more")
        if self.outage_give_up_s < 0:
            raise SettingsError(f"outage_give_up_s={self.outage_give_up_s}: use 0 (give up at the first failure) or more")
        if self.sync_retries < 1:
            raise SettingsError(f"sync_retries={self.sync_retries}: at least one attempt is needed (--sync-retries 1 or more)")
        if self.sync_bucket_mb <= 0:
            raise SettingsError(f"sync_bucket_mb={self.sync_bucket_mb}: use a positive bucket size, e.g. 256")
        if self.save_every < 0 or self.steps < 0 or self.keep_checkpoints < 0:
            raise SettingsError("steps, save_every and keep_checkpoints must be 0 or positive")
        if self.release_memory != "none" and (self.sync_mode == "none" or not self.gateway):
            raise SettingsError(
                f"release_memory={self.release_memory} pauses generation through the gateway and takes the engines' "
                "memory back before pushing the new weights: it needs --gateway and a --sync-mode other than none"
            )
        if self.lora_rank < 0:
            raise SettingsError(f"lora_rank={self.lora_rank}: use 0 (full fine-tuning) or a positive rank, e.g. --lora-rank 16")
        if self.lora_rank and not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):
            raise SettingsError(f"lora_alpha={self.lora_alpha}: use a positive scale, e.g. --lora-alpha 32")
        if self.lora_rank and not self.lora_targets:
            raise SettingsError("lora_targets is empty: give module names (e.g. --lora-targets q_proj,v_proj) or all-linear")
        if self.lora_rank and self.sync_mode == "broadcast":
            raise SettingsError(
                "--lora-rank with --sync-mode broadcast: adapters are pushed by disk (/load_lora_adapter) or by tensor "
                "handles (/load_lora_adapter_from_tensors); use --sync-mode disk or tensor"
            )
        if self.lora_rank and not self.lora_name.strip():
            raise SettingsError("lora_name is empty: the engines need a name for the adapter, e.g. --lora-name policy")
        if self.sync_mode != "none" and not (self.gateway or self.engine_urls):
            raise SettingsError(
                f"sync_mode={self.sync_mode} needs somewhere to push weights: give --gateway URL (engines are asked "
                "from it) or --engine-urls, or use --sync-mode none"
            )

    @property
    def lora(self):
        """The :class:`trainer.lora.LoraSpec` of a LoRA run, or None for full fine-tuning."""
        from trainer.lora import LoraSpec

        return LoraSpec(self.lora_rank, self.lora_alpha, tuple(self.lora_targets)) if self.lora_rank else None

    @property
    def is_cap_or_none(self) -> float | None:
        return self.is_cap if self.is_cap > 0 else None

    @property
    def gamma_or_none(self) -> float | None:
        return None if self.gamma == -1.0 else self.gamma


def check_row_fits(num_tokens: int, settings: TrainerSettings, row_id: str = "") -> None:
    """A row longer than the micro-batch budget can never be trained on: say how to fix it."""
    if num_tokens > settings.micro_batch_tokens:
        raise SettingsError(
            f"row {row_id} has {num_tokens} tokens but micro_batch_tokens={settings.micro_batch_tokens}; a row "
            f"is never split across micro-batches, so raise --micro-batch-tokens to at least {num_tokens} "
            "(or cap the agents' max tokens)"
        )
