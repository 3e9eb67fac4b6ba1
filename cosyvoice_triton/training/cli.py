"""Command-line options of `cosyvoice-triton finetune` and `python -m cosyvoice_triton.training` (torchrun)."""
from __future__ import annotations

import argparse
from pathlib import Path

from cosyvoice_triton.training import PARTS, PRECISIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, type=Path,
                   help="folder of recordings with metadata.csv (file|text) or Kaldi wav.scp + text")
    p.add_argument("--model-dir", required=True, help="base model folder (or hub id) in the released layout")
    p.add_argument("--out", required=True, type=Path,
                   help="new model folder; its finetune/ subfolder keeps features, checkpoints and logs")
    p.add_argument("--part", choices=PARTS, default="llm", help="which model to train (default: llm)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (merged into the weights at the end)")
    p.add_argument("--lora-rank", type=int, default=16, help="with --lora: the adapters' rank (default %(default)s)")
    p.add_argument("--lora-alpha", type=int, default=32,
                   help="with --lora: the adapters' scale numerator, alpha / rank (default %(default)s)")
    p.add_argument("--max-steps", type=int, default=2000, help="optimizer steps in all (a resumed run included)")
    p.add_argument("--batch-size", type=int, default=16, help="recordings per batch, at most")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="padded speech tokens per batch, at most (0: no limit beyond --batch-size)")
    p.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (official recipe: 1e-5)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="0: constant LR (the recipe's fine-tuning schedule); N: the recipe's warmuplr")
    p.add_argument("--grad-accum", type=int, default=2, help="batches per optimizer step (recipe: 2)")
    p.add_argument("--grad-clip", type=float, default=5.0, help="gradient norm limit per part (recipe: 5)")
    p.add_argument("--val-share", type=float, default=0.05, help="share of recordings held out for validation")
    p.add_argument("--val-every", type=int, default=200, help="steps between validation losses")
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT/finetune")
    p.add_argument("--average", type=int, default=1, help="write the mean of the last N checkpoints")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if there is a GPU), cpu, cuda, ...")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="auto: bf16 autocast on GPUs that support it, else fp32")
    p.add_argument("--log-dir", type=Path, default=None, help="TensorBoard folder (default OUT/finetune/tensorboard)")
    p.add_argument("--seed", type=int, default=1986,
                   help="seed of the batch order and the training's random draws (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from cosyvoice_triton.model_hub import resolve_model_dir
    from cosyvoice_triton.training.lora import LoraOptions
    from cosyvoice_triton.training.trainer import FinetuneOptions, finetune

    options = FinetuneOptions(
        data_dir=args.data, model_dir=Path(resolve_model_dir(args.model_dir)), out_dir=args.out, part=args.part,
        lora=args.lora, lora_options=LoraOptions(rank=args.lora_rank, alpha=args.lora_alpha),
        max_steps=args.max_steps, batch_size=args.batch_size, max_tokens=args.max_tokens, lr=args.lr,
        warmup_steps=args.warmup_steps, grad_accum=args.grad_accum, grad_clip=args.grad_clip,
        val_share=args.val_share, val_every=args.val_every, save_every=args.save_every, resume=args.resume,
        average=args.average, device=args.device, precision=args.precision, log_dir=args.log_dir, seed=args.seed,
        progress=not args.no_progress)
    finetune(options)
    return 0
