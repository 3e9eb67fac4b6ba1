"""What the batch-invariant decode costs (models/llm_precision.py, "Batch-invariant decode"): the LLM's decode step
at the released widths (24 layers, random weights: no model folder needed), its rows apart (the CPU default)
against its rows batched (what a compiled LLM runs), interleaved in one process, at 1 and 4 rows.

    python -m cosyvoice_triton.perf.decode_rows --precisions int8 int8-dynamic fp32 bf16 --threads 2

Prints ms per step (median and best of `--steps`) and tokens per second, per precision, rows and mode.
"""
from __future__ import annotations

import argparse
import statistics
import time


def released_width_lm(precision: str, slots: int, max_seq_len: int = 1024, layers: int = 24):
    """SpeechLM at the released widths (hidden 896, 14 heads over 2 key/value heads, MLP 4864, 6564 speech
    classes) with `layers` random layers, set up as from_model_dir sets it up on a CPU."""
    import torch

    from cosyvoice_triton.models.qwen2 import Qwen2Config
    from cosyvoice_triton.models.speech_lm import SpeechLM, SpeechLMConfig

    torch.manual_seed(0)
    qwen = Qwen2Config(vocab_size=8192, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                       num_attention_heads=14, num_key_value_heads=2)
    llm = SpeechLM(SpeechLMConfig(896, 896, 6561, qwen), max_seq_len=max_seq_len).eval()
    with torch.no_grad():
        for parameter in llm.parameters():
            parameter.normal_(0, 0.02)
    llm.set_precision(precision)
    llm.multiply_rows_apart()
    llm.setup_caches(slots)
    return llm


def rows_batched(llm, batched: bool) -> None:
    """Switch the decode between rows apart (False: the CPU default) and rows batched (True: every Linear
    and the attention over the whole batch, the decode before batch invariance)."""
    from cosyvoice_triton.models.llm_precision import multiply_rows_together

    if batched:
        multiply_rows_together(llm)
        for layer in llm.backbone.layers:
            layer.self_attn.rows_apart = False
    else:
        llm.multiply_rows_apart()


def measure(precision: str, steps: int, rows: tuple[int, ...] = (1, 4)) -> list[dict]:
    import torch

    from cosyvoice_triton.models.qwen2 import kv_bucket

    llm = released_width_lm(precision, max(rows))
    none = torch.zeros(1, 0, dtype=torch.long)
    positions = []
    for slot in range(max(rows)):  # prompts of 200, 230, 260, ... positions
        x = llm.build_prompt(torch.randint(0, 1000, (1, 200 + 30 * slot)), none, none)
        llm.step_logits(x, torch.arange(x.shape[1])[None], torch.tensor([slot]), kv_bucket(x.shape[1], 1024))
        positions.append(x.shape[1])

    def step(batch: int) -> float:
        tokens = torch.full((batch, 1), 7)
        input_pos = torch.tensor([[p] for p in positions[:batch]])
        start = time.perf_counter()
        llm.step_logits(llm.embed_speech(tokens), input_pos, torch.arange(batch),
                        kv_bucket(max(positions[:batch]) + 1, 1024))
        return time.perf_counter() - start

    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(steps + 2):  # the first two rounds warm up
        for mode in ("batched", "apart"):
            rows_batched(llm, mode == "batched")
            for batch in rows:
                times.setdefault((mode, batch), []).append(step(batch))
    results = []
    for (mode, batch), seconds in times.items():
        median = statistics.median(seconds[2:])
        results.append({"precision": precision, "rows": batch, "mode": mode, "median_ms": 1000 * median,
                        "best_ms": 1000 * min(seconds[2:]), "tokens_per_s": batch / median})
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", nargs="+", default=["int8", "int8-dynamic", "fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} torch threads")
    for precision in args.precisions:
        for r in measure(precision, args.steps):
            print(f"{r['precision']:13s} rows {r['rows']}  {r['mode']:7s}  {r['median_ms']:7.1f} ms/step "
                  f"(best {r['best_ms']:.1f})  {r['tokens_per_s']:5.1f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
