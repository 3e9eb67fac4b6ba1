"""Fine-tuning CosyVoice2 or CosyVoice3 (the base folder decides) on a user's own recordings
(`cosyvoice-triton finetune`).

data_prep: recordings + transcripts -> cached features; dataset: batches; losses: the official training
losses; lora: peft adapters; trainer: the loop (one device or torchrun DDP); devices: rank, device and
autocast; checkpoints: resume and averaging; model_folder: the output folder in the released layout;
cli: the command's options (`__main__` runs them under torchrun).
"""

PARTS = ("llm", "flow", "both")  # --part: what to train
PRECISIONS = ("auto", "bf16", "fp32")  # --precision
