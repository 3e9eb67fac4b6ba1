"""The fine-tuning run: prepare features, train the LLM and/or the flow, write the model folder.

One process per device. Under torchrun (`WORLD_SIZE` > 1 in the environment) the processes join one
process group (NCCL on CUDA, gloo on the CPU), wrap the train module in DistributedDataParallel and
each take their share of every epoch's batches; rank 0 alone writes checkpoints, logs and the folder.

The base folder decides the family (its yaml): the speech LM takes the family's layout, the flow is the
family's class (`models/family.py`), and the losses are written once for both (`losses.py`).

Defaults follow the official recipes' `train_conf` (examples/libritts/cosyvoice2/conf/cosyvoice2.yaml; the
CosyVoice3 recipe's is the same):
Adam, lr 1e-5, gradient clipping at 5, 2 accumulated batches per step, constant LR (the recipe's setting
for fine-tuning); `warmup_steps` > 0 switches to the recipe's `warmuplr` schedule
(lr * sqrt(warmup) * min(step^-0.5, step * warmup^-1.5)).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.models.family import family_models
from cosyvoice_triton.models.flow import TokenToMel
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.training import PARTS, checkpoints
from cosyvoice_triton.training.data_prep import (DataError, Example, prepare_examples, read_manifest,
                                                 report_skipped)
from cosyvoice_triton.training.dataset import Batch, collate, epoch_batches, split_train_val
from cosyvoice_triton.training.devices import Distributed, FinetuneError, autocast_dtype, pick_device
from cosyvoice_triton.training.lora import FLOW_TARGETS, LLM_TARGETS, LoraOptions, add_lora, merge_lora
from cosyvoice_triton.training.losses import (FlowLossConfig, FlowNoise, draw_bistream, draw_flow_noise,
                                              draw_prompt_frames, draw_streaming, flow_loss, llm_label_smoothing,
                                              lm_loss)
from cosyvoice_triton.training.model_folder import RUN_FOLDER, write_model_folder

VALIDATION_SEED = 12345  # the same draws at every validation, so its losses are comparable


@dataclass(frozen=True)
class FinetuneOptions:
    data_dir: Path
    model_dir: Path
    out_dir: Path
    part: str = "llm"
    lora: bool = False
    lora_options: LoraOptions = field(default_factory=LoraOptions)
    max_steps: int = 2000
    batch_size: int = 16
    max_tokens: int = 0  # 0: batches limited by batch_size only
    lr: float = 1e-5
    warmup_steps: int = 0
    grad_accum: int = 2
    grad_clip: float = 5.0
    val_share: float = 0.05
    val_every: int = 200
    save_every: int = 500
    resume: bool = False
    average: int = 1
    device: str = "auto"
    precision: str = "auto"
    log_dir: Path | None = None
    seed: int = 1986
    progress: bool = True

    @property
    def run_dir(self) -> Path:
        return self.out_dir / RUN_FOLDER

    @property
    def parts(self) -> tuple[str, ...]:
        return ("llm", "flow") if self.part == "both" else (self.part,)


@dataclass
class FlowDraws:
    noise: FlowNoise
    prompt_frames: Tensor
    streaming: bool


@dataclass
class Draws:
    """One batch's random choices, from the run's generator (saved in checkpoints: a resumed run draws on)."""

    bistream: Tensor | None  # (B,) bool: the LLM's rows drawn for the bistream layout; None without the LLM
    flow: FlowDraws | None  # None without the flow


class TrainModule(nn.Module):
    """The models being trained; forward returns each part's loss (one module, so DDP can wrap it)."""

    def __init__(self, llm: SpeechLM | None, flow: TokenToMel | None, flow_config: FlowLossConfig,
                 label_smoothing: float):
        super().__init__()
        self.llm = llm
        self.flow = flow
        self.flow_config = flow_config
        self.label_smoothing = label_smoothing

    def forward(self, batch: Batch, draws: Draws) -> dict[str, Tensor]:
        losses = {}
        if self.llm is not None:
            losses["llm"] = lm_loss(self.llm, batch.lm, self.label_smoothing, draws.bistream).loss
        if self.flow is not None:
            flow = draws.flow
            losses["flow"] = flow_loss(self.flow, batch.flow, flow.noise, flow.prompt_frames, flow.streaming,
                                       self.flow_config.sigma_min, self.flow_config.training_cfg_rate).loss
        return losses


def lr_factor(step: int, warmup_steps: int) -> float:
    """LR multiplier after `step` scheduler steps: 1 (constant) or the recipe's warmuplr."""
    if warmup_steps <= 0:
        return 1.0
    n = step + 1
    return warmup_steps ** 0.5 * min(n ** -0.5, n * warmup_steps ** -1.5)


def build_module(options: FinetuneOptions, max_seq_len: int, device: torch.device) -> TrainModule:
    root = read_yaml(ModelPaths(options.model_dir).yaml)
    llm = flow = None
    if "llm" in options.parts:
        llm = SpeechLM.from_model_dir(options.model_dir, device="cpu", max_seq_len=max_seq_len)
        if options.lora:
            add_lora(llm, LLM_TARGETS, options.lora_options)
    if "flow" in options.parts:
        flow = family_models(options.model_dir).load_flow(options.model_dir, device="cpu")
        if options.lora:
            add_lora(flow, FLOW_TARGETS, options.lora_options)
    module = TrainModule(llm, flow, FlowLossConfig.from_yaml(root), llm_label_smoothing(root))
    return module.to(device).train()


def released_weights(module: TrainModule) -> dict[str, dict[str, Tensor]]:
    """{"llm.pt": ..., "flow.pt": ...}: the trained parts with LoRA merged, in the released key layout."""
    weights = {}
    for name, file_name in (("llm", "llm.pt"), ("flow", "flow.pt")):
        part = getattr(module, name)
        if part is not None:
            weights[file_name] = merge_lora(copy.deepcopy(part)).state_dict()
    return weights


class Run:
    """State of one fine-tuning run (created by `finetune`)."""

    def __init__(self, options: FinetuneOptions, ddp: Distributed, train: list[Example], val: list[Example]):
        self.options = options
        self.ddp = ddp
        self.device = pick_device(options.device, ddp)
        self.amp_dtype = autocast_dtype(options.precision, self.device)
        self.train_examples, self.val_examples = train, val
        max_seq_len = max(e.instruct_token.size + e.text_token.size + e.speech_token.size for e in train + val) + 2
        self.module = build_module(options, max(256, max_seq_len), self.device)
        self.token_mel_ratio = self.module.flow.config.token_mel_ratio if self.module.flow is not None else 2
        self.model: nn.Module = self.module
        if ddp.world_size > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            # buffers (RoPE tables, KV caches, the flow's fixed noise) are equal on every rank: no syncing
            quiet = ("forward_sync_buffers" if "forward_sync_buffers" in
                     inspect.signature(nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers")
            self.model = nn.parallel.DistributedDataParallel(self.module, device_ids=device_ids, **{quiet: False})
        self.parameters = {name: [p for p in getattr(self.module, name).parameters() if p.requires_grad]
                           for name in options.parts}
        self.optimizer = torch.optim.Adam([p for ps in self.parameters.values() for p in ps], lr=options.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, options.warmup_steps))
        self.generator = torch.Generator().manual_seed(options.seed + 7919 * ddp.rank)  # the training's draws
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.checkpoint_dir = options.run_dir / "checkpoints"
        self.metrics_path = options.run_dir / "metrics.jsonl"
        self.writer = None

    # --- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "part": self.options.part, "lora": self.options.lora,
                "module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                "generator": self.generator.get_state()}

    def save(self) -> Path:
        path = checkpoints.checkpoint_path(self.checkpoint_dir, self.step)
        if self.ddp.is_main:
            checkpoints.save_checkpoint(path, self.state())
        return path

    def restore(self, path: Path) -> None:
        state = checkpoints.load_checkpoint(path)
        if (state["part"], state["lora"]) != (self.options.part, self.options.lora):
            raise FinetuneError(f"{path} is a --part {state['part']} {'--lora ' if state['lora'] else ''}run; "
                                f"resume it with the same options")
        self.module.load_state_dict(state["module"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.generator.set_state(state["generator"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]

    # --- data --------------------------------------------------------------------------------------
    def batches(self) -> Iterator[Batch]:
        """This rank's batches from the saved position on, epoch after epoch."""
        lengths = [e.speech_token.size for e in self.train_examples]
        while True:
            plan = epoch_batches(lengths, self.epoch, self.options.seed, self.options.batch_size,
                                 self.options.max_tokens, self.ddp.rank, self.ddp.world_size)
            while self.batch_in_epoch < len(plan):
                indices = plan[self.batch_in_epoch]
                self.batch_in_epoch += 1
                yield collate([self.train_examples[i] for i in indices], self.token_mel_ratio).to(self.device)
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def draws(self, batch: Batch, generator: torch.Generator) -> Draws:
        rows = batch.lm.text_token.size(0)
        bistream = None if self.module.llm is None else draw_bistream(rows, generator).to(self.device)
        return Draws(bistream, self.flow_draws(batch, generator))

    def flow_draws(self, batch: Batch, generator: torch.Generator) -> FlowDraws | None:
        if self.module.flow is None:
            return None
        feat = batch.flow.speech_feat  # (B, T_mel, 80)
        noise = draw_flow_noise(feat.size(0), feat.size(2), feat.size(1), self.module.flow_config.training_cfg_rate,
                                generator)
        noise.t, noise.z, noise.keep_condition = (x.to(self.device) for x in (noise.t, noise.z, noise.keep_condition))
        mel_len = self.token_mel_ratio * batch.flow.speech_token_len
        return FlowDraws(noise, draw_prompt_frames(mel_len, generator).to(self.device), draw_streaming(generator))

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # --- steps -------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator[Batch]) -> dict[str, float]:
        """One optimizer step over `grad_accum` batches; the mean loss of each part."""
        totals = {name: 0.0 for name in self.options.parts}
        for k in range(self.options.grad_accum):
            batch = next(batches)
            last = k == self.options.grad_accum - 1
            sync = contextlib.nullcontext() if last or self.model is self.module else self.model.no_sync()
            with sync:
                with self.autocast():
                    losses = self.model(batch, self.draws(batch, self.generator))
                (sum(losses.values()) / self.options.grad_accum).backward()
            for name, loss in losses.items():
                totals[name] += loss.item() / self.options.grad_accum
        if self.ddp.world_size > 1:  # log the mean over ranks
            values = torch.tensor(list(totals.values()), dtype=torch.float64, device=self.device)
            dist.all_reduce(values)
            totals = dict(zip(totals, (values / self.ddp.world_size).tolist()))
        for params in self.parameters.values():  # clipped per part, as when the parts train apart
            torch.nn.utils.clip_grad_norm_(params, self.options.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return totals

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean loss per part over the held-out examples, with the same draws every time."""
        if not self.val_examples:
            return {}
        self.module.eval()
        generator = torch.Generator().manual_seed(VALIDATION_SEED)
        totals = {name: 0.0 for name in self.options.parts}
        size = self.options.batch_size
        for start in range(0, len(self.val_examples), size):
            rows = self.val_examples[start:start + size]
            batch = collate(rows, self.token_mel_ratio).to(self.device)
            with self.autocast():
                losses = self.module(batch, self.draws(batch, generator))
            for name, loss in losses.items():
                totals[name] += loss.item() * len(rows) / len(self.val_examples)
        self.module.train()
        return totals

    def log(self, record: dict) -> None:
        if not self.ddp.is_main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()

    def open_logs(self) -> None:
        if self.ddp.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.options.log_dir or self.options.run_dir / "tensorboard"))

    def train(self) -> dict[str, float]:
        options = self.options
        batches = self.batches()
        bar = tqdm(total=options.max_steps, initial=self.step, desc="fine-tuning", unit="step", file=sys.stderr,
                   disable=not (options.progress and self.ddp.is_main), dynamic_ncols=True)
        val = {}
        if self.step == 0:  # the base model's validation loss: where the curve starts
            self.log({"step": 0, **{f"val/{name}_loss": value for name, value in self.validate().items()}})
        try:
            while self.step < options.max_steps:
                losses = self.train_step(batches)
                record = {"step": self.step, "lr": self.scheduler.get_last_lr()[0],
                          **{f"train/{name}_loss": value for name, value in losses.items()}}
                if self.step % options.val_every == 0 or self.step == options.max_steps:
                    val = self.validate()
                    record.update({f"val/{name}_loss": value for name, value in val.items()})
                self.log(record)
                bar.update(1)
                bar.set_postfix({name: f"{value:.3f}" for name, value in losses.items()})
                if self.step % options.save_every == 0 or self.step == options.max_steps:
                    self.save()
        except KeyboardInterrupt:
            if self.ddp.is_main:
                print(f"\ninterrupted: saved {self.save()}; continue with --resume", file=sys.stderr)
            raise
        finally:
            bar.close()
            if self.writer is not None:
                self.writer.close()
        return val

    def final_weights(self) -> dict[str, dict[str, Tensor]]:
        """The trained weights, or the mean of the last `average` checkpoints (merged if LoRA)."""
        if self.options.average <= 1:
            return released_weights(self.module)
        paths = checkpoints.list_checkpoints(self.checkpoint_dir)[-self.options.average:]
        print(f"averaging {len(paths)} checkpoints: {', '.join(p.name for p in paths)}", file=sys.stderr)
        per_checkpoint = []
        for path in paths:
            self.module.load_state_dict(checkpoints.load_checkpoint(path)["module"], strict=True)
            per_checkpoint.append(released_weights(self.module))
        return {name: checkpoints.average_state_dicts([w[name] for w in per_checkpoint]) for name in per_checkpoint[0]}


def load_examples(options: FinetuneOptions, ddp: Distributed) -> tuple[list[Example], list[Example]]:
    utterances, skipped = read_manifest(options.data_dir)
    cache_dir = options.run_dir / "features"
    if ddp.is_main:  # rank 0 fills the cache; the others then read it
        total = len(utterances) + len(skipped)  # manifest lines that name no usable utterance count too
        examples, more = prepare_examples(utterances, options.model_dir, cache_dir, options.progress)
        skipped += more
        report_skipped(skipped, total)
        with open(options.run_dir / "skipped.tsv", "w") as f:
            f.writelines(f"{s.name}\t{s.reason}\n" for s in skipped)
    ddp.barrier()
    if not ddp.is_main:
        examples, _ = prepare_examples(utterances, options.model_dir, cache_dir, progress=False)
    if len(examples) < 2:
        raise DataError(f"{options.data_dir}: {len(examples)} usable recordings; at least 2 are needed")
    return split_train_val(examples, options.val_share)


def check_options(options: FinetuneOptions) -> None:
    if options.part not in PARTS:
        raise FinetuneError(f"--part must be one of {PARTS}")
    if options.out_dir.resolve() == options.model_dir.resolve():
        raise FinetuneError("--out must differ from --model-dir: the base folder stays unchanged")
    missing = ModelPaths(options.model_dir).missing()
    if missing:
        raise FinetuneError(f"{options.model_dir} is not a CosyVoice model folder: missing {', '.join(missing)}")
    for name in ("max_steps", "batch_size", "grad_accum", "val_every", "save_every", "average"):
        if getattr(options, name) < 1:
            raise FinetuneError(f"--{name.replace('_', '-')} must be at least 1")
    existing = checkpoints.list_checkpoints(options.run_dir / "checkpoints")
    if existing and not options.resume:
        raise FinetuneError(f"{options.out_dir} has checkpoints of an earlier run ({existing[-1].name}): "
                            "pass --resume to continue it, or choose another --out")


def finetune(options: FinetuneOptions) -> Path:
    """The whole run; returns the output model folder."""
    check_options(options)
    ddp = Distributed.from_env()
    if ddp.world_size > 1:
        device = pick_device(options.device, ddp)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        options.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(options.seed)
        train, val = load_examples(options, ddp)
        run = Run(options, ddp, train, val)
        latest = checkpoints.list_checkpoints(run.checkpoint_dir)
        if options.resume and latest:
            run.restore(latest[-1])
            if ddp.is_main:
                print(f"resuming from {latest[-1].name} (step {run.step})", file=sys.stderr)
        elif ddp.is_main:
            run.metrics_path.unlink(missing_ok=True)
            (options.run_dir / "options.json").write_text(json.dumps(asdict(options), default=str, indent=1))
        if ddp.is_main:
            print(f"{len(train)} training and {len(val)} validation recordings; parts: {', '.join(options.parts)}"
                  f"{' (LoRA)' if options.lora else ''}; device {run.device}"
                  f"{', bf16 autocast' if run.amp_dtype else ''}; world size {ddp.world_size}", file=sys.stderr)
        run.open_logs()
        val = run.train()
        ddp.barrier()
        if ddp.is_main:
            write_model_folder(options.model_dir, options.out_dir, run.final_weights())
            summary = ", ".join(f"{name} {value:.4f}" for name, value in val.items())
            print(f"wrote {options.out_dir} (step {run.step}; validation loss {summary or 'n/a'})", file=sys.stderr)
        ddp.barrier()
        return options.out_dir
    finally:
        if ddp.world_size > 1:
            dist.destroy_process_group()
