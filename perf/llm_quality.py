"""Quality and speed of the LLM precisions (fp32 | bf16 | int8 | int8-dynamic) against the fp32 reference.

    python -m cosyvoice_triton.perf.llm_quality --model-dir DIR [--steps 250] [--text-tokens 40]
        [--prompt-tokens 75] [--timing-steps 10] [--generate-steps 250] [--generate-seeds 0 1]
        [--precisions bf16 int8 int8-dynamic] [--json OUT]

Teacher-forced: one fixed sequence (random text, prompt text and prompt speech ids, then `--steps`
forced speech tokens, seeded) is scored by every precision in one cache-free causal pass; at each of
the steps + 1 positions the next-token distributions are compared with fp32's:
- mean KL(p_fp32 || p_x) per step, in nats (the default precision must stay <= 1e-3);
- top-1 agreement (share of steps whose most likely token is fp32's);
- max |delta log p| over the steps, of the tokens fp32 gives p >= 1e-3 (rarer tokens are almost
  never drawn and their log-probs are dominated by rounding).
Free-running: each precision decodes `--generate-steps` tokens of the same request greedily, and with the
released sampling (repetition-aware, top-k 25, top-p 0.8) and the same seed as fp32 (`--generate-seeds`);
the token agreement (perf/quality.py `token_agreement`, the mean over seeds): the share of fp32's tokens
before the first difference, and of positions equal overall (after a difference the two streams speak
different, equally valid speech, so the overall share falls to chance). The sampler draws a position in the
top-k sorted by probability, so two near-equal tokens that swap places change the draw. Reported, not a
gate: the gate is the KL bound.
Then the time of one cached decode step at the prompt's context (median of `--timing-steps`), the
precisions interleaved step by step, with the load average; ratios are against fp32.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.messages import SamplingParams
from cosyvoice_triton.models.llm_precision import LLM_PRECISIONS, cpu_has_bf16
from cosyvoice_triton.models.qwen2 import kv_bucket
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.perf.quality import token_agreement

PROBABLE = 1e-3  # max |delta log p| counts tokens fp32 gives at least this probability


@dataclass(frozen=True)
class Quality:
    precision: str
    mean_kl: float  # nats per step, KL(fp32 || this)
    top1_agreement: float  # share of steps
    max_abs_dlogp: float  # over tokens with p_fp32 >= PROBABLE
    token_prefix: float | None = None  # sampled, free-running: share of fp32's tokens before the first difference
    token_overall: float | None = None  # sampled: share of positions equal
    greedy_prefix: float | None = None  # greedy: share of fp32's tokens before the first difference


def random_request(llm: SpeechLM, steps: int, text_tokens: int, prompt_tokens: int,
                   seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A seeded random request: (text, prompt text, prompt speech, `steps` forced speech tokens), each (1, N)."""
    rng = torch.Generator().manual_seed(seed)
    config = llm.config
    text = torch.randint(config.qwen.vocab_size, (1, text_tokens), generator=rng)
    prompt_text = torch.randint(config.qwen.vocab_size, (1, max(1, text_tokens // 4)), generator=rng)
    prompt_speech = torch.randint(config.speech_token_size, (1, prompt_tokens), generator=rng)
    forced = torch.randint(config.speech_token_size, (1, steps), generator=rng)
    return text, prompt_text, prompt_speech, forced


@torch.inference_mode()
def forced_sequence(llm: SpeechLM, steps: int, text_tokens: int, prompt_tokens: int,
                    seed: int = 0) -> tuple[torch.Tensor, int]:
    """The fp32 decoder input (1, L + steps, D) of a seeded random request and its prompt length L."""
    text, prompt_text, prompt_speech, forced = random_request(llm, steps, text_tokens, prompt_tokens, seed)
    prompt = llm.build_prompt(text, prompt_text, prompt_speech)  # (1, L, D)
    return torch.cat([prompt, llm.embed_speech(forced)], dim=1), prompt.shape[1]


def decoded(llm: SpeechLM, steps: int, text_tokens: int, prompt_tokens: int, seed: int,
            greedy: bool = False) -> list[int]:
    """Up to `steps` tokens decoded free-running for the random request: the released sampling seeded with
    `seed`, or the most likely token at every step."""
    text, prompt_text, prompt_speech, _ = random_request(llm, 0, text_tokens, prompt_tokens)
    sampler = (lambda logp, history, generator: int(logp.argmax())) if greedy else None
    tokens = generate(llm, text, prompt_text, prompt_speech, SamplingParams(seed=seed), sampler=sampler)
    return list(itertools.islice(tokens, steps))


def with_agreement(row: Quality, reference: dict[str, list[list[int]]], candidate: dict[str, list[list[int]]]
                   ) -> Quality:
    """row with the mean token agreement of each seed's two decodes, sampled and greedy."""
    def mean_agreement(kind: str) -> tuple[float, float]:
        pairs = [token_agreement(r, c) for r, c in zip(reference[kind], candidate[kind])]
        return statistics.mean(p for p, _ in pairs), statistics.mean(o for _, o in pairs)

    (prefix, overall), (greedy, _) = mean_agreement("sampled"), mean_agreement("greedy")
    return dataclasses.replace(row, token_prefix=prefix, token_overall=overall, greedy_prefix=greedy)


@torch.inference_mode()
def step_log_probs(llm: SpeechLM, x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs (steps + 1, V) of the next token after the prompt and after each forced token."""
    logits = llm.logits_full(x.to(llm.speech_embedding.weight.dtype))[0, prompt_len - 1:]  # (steps + 1, V)
    return logits.float().log_softmax(dim=-1)


def compare(precision: str, reference: torch.Tensor, candidate: torch.Tensor) -> Quality:
    """reference, candidate: log-probs (N, V) of the same N steps."""
    kl = (reference.exp() * (reference - candidate)).sum(dim=-1)  # (N,)
    agree = (reference.argmax(dim=-1) == candidate.argmax(dim=-1)).float().mean()
    probable = reference >= torch.log(torch.tensor(PROBABLE))
    dlogp = (reference - candidate).abs()[probable]
    return Quality(precision, float(kl.mean()), float(agree), float(dlogp.max()))


@torch.inference_mode()
def decode_step_ms(models: dict[str, SpeechLM], x: torch.Tensor, prompt_len: int, repeats: int) -> dict[str, float]:
    """Median ms of one cached decode step at context prompt_len, the precisions interleaved."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for name, llm in models.items():  # prefill each cache once
        llm.step_logits(x[:, :prompt_len].to(llm.speech_embedding.weight.dtype), torch.arange(prompt_len)[None],
                        torch.tensor([0]), kv_bucket(prompt_len, llm.max_seq_len))
    step_input = x[:, prompt_len:prompt_len + 1]
    for _ in range(repeats + 1):  # the first round is a warm-up
        for name, llm in models.items():
            start = time.perf_counter()
            llm.step_logits(step_input.to(llm.speech_embedding.weight.dtype), torch.tensor([[prompt_len]]),
                            torch.tensor([0]), kv_bucket(prompt_len + 1, llm.max_seq_len))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}


def quality_table(model_dir: str, precisions: tuple[str, ...] = LLM_PRECISIONS, steps: int = 250,
                  text_tokens: int = 40, prompt_tokens: int = 75) -> tuple[list[Quality], dict[str, SpeechLM], tuple]:
    max_seq_len = kv_bucket(3 + text_tokens + text_tokens // 4 + prompt_tokens + steps, 1 << 20)
    models = {p: SpeechLM.from_model_dir(model_dir, max_seq_len=max_seq_len, precision=p) for p in precisions}
    reference = models["fp32"]
    x, prompt_len = forced_sequence(reference, steps, text_tokens, prompt_tokens)
    ref_logp = step_log_probs(reference, x, prompt_len)
    rows = [compare(p, ref_logp, step_log_probs(llm, x, prompt_len)) for p, llm in models.items()]
    return rows, models, (x, prompt_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--text-tokens", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--timing-steps", type=int, default=10, help="0: no timing")
    parser.add_argument("--generate-steps", type=int, default=250, help="free-running tokens per seed; 0: none")
    parser.add_argument("--generate-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--precisions", nargs="+", default=list(LLM_PRECISIONS[1:]), choices=LLM_PRECISIONS[1:],
                        help="the reduced precisions to compare with fp32")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # One reduced-precision model beside fp32 at a time (a full-size LLM takes a few GB).
    longest = max(args.steps, args.generate_steps)
    max_seq_len = kv_bucket(3 + args.text_tokens + args.text_tokens // 4 + args.prompt_tokens + longest, 1 << 20)
    reference = SpeechLM.from_model_dir(args.model_dir, max_seq_len=max_seq_len)
    x, prompt_len = forced_sequence(reference, args.steps, args.text_tokens, args.prompt_tokens)
    ref_logp = step_log_probs(reference, x, prompt_len)

    def decodes(llm: SpeechLM) -> dict[str, list[list[int]]]:
        """Each seed's sampled decode, and the greedy one (no seed)."""
        def run(seed: int, greedy: bool = False) -> list[int]:
            return decoded(llm, args.generate_steps, args.text_tokens, args.prompt_tokens, seed, greedy)

        return {"sampled": [run(seed) for seed in args.generate_seeds], "greedy": [run(0, greedy=True)]}

    ref_tokens = decodes(reference) if args.generate_steps else None
    fp32 = compare("fp32", ref_logp, ref_logp)
    rows, ms, loads = [with_agreement(fp32, ref_tokens, ref_tokens) if ref_tokens else fp32], {}, [os.getloadavg()[0]]
    for precision in args.precisions:
        candidate = SpeechLM.from_model_dir(args.model_dir, max_seq_len=max_seq_len, precision=precision)
        row = compare(precision, ref_logp, step_log_probs(candidate, x, prompt_len))
        rows.append(with_agreement(row, ref_tokens, decodes(candidate)) if ref_tokens else row)
        if args.timing_steps:
            pair = decode_step_ms({"fp32": reference, precision: candidate}, x, prompt_len, args.timing_steps)
            ms.setdefault("fp32", []).append(pair["fp32"])
            ms[precision] = [pair[precision] * 1.0]
            ms[f"{precision}/fp32"] = [pair[precision] / pair["fp32"]]
        del candidate
        loads.append(os.getloadavg()[0])
    ms = {key: statistics.median(values) for key, values in ms.items()}
    load = (min(loads), max(loads))
    print(f"model {args.model_dir}; {args.steps} teacher-forced steps, context {prompt_len}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; CPU capability {torch.backends.cpu.get_cpu_capability()}, bf16 "
          f"instructions {cpu_has_bf16()}, quantized engine {torch.backends.quantized.engine}; "
          f"load average {load[0]:.1f}-{load[1]:.1f}; ratios against fp32 timed in the same pair")
    print(f"Token agreement: {args.generate_steps} free-running tokens; sampled: seeds {args.generate_seeds}, mean")
    print("| precision | mean KL (nats/step) | top-1 agreement | max abs d log p | sampled: tokens before the first "
          "difference | sampled: equal overall | greedy: before the first difference | decode step (ms) | / fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        step = ms.get(row.precision)
        ratio = ms.get(f"{row.precision}/fp32", 1.0)
        timing = f"{step:.1f} | {ratio:.2f}" if step else "- | -"
        agreement = "- | - | -" if row.token_prefix is None else \
            f"{100 * row.token_prefix:.1f} % | {100 * row.token_overall:.1f} % | {100 * row.greedy_prefix:.1f} %"
        print(f"| {row.precision} | {row.mean_kl:.2e} | {100 * row.top1_agreement:.1f} % | {row.max_abs_dlogp:.3f} "
              f"| {agreement} | {timing} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "decode_step_ms": ms, "load_average": load,
                       "context": prompt_len, "steps": args.steps}, f, indent=1)


if __name__ == "__main__":
    main()
