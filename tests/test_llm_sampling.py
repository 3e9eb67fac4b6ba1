"""Sampling, per-request generators and the slot/position logic of the speech LM's KV cache."""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

import pytest
import torch

from cosyvoice_triton.config import read_yaml
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import SamplingParams
from cosyvoice_triton.models.speech_lm import SpeechLM
from cosyvoice_triton.llm.generate import generate
from cosyvoice_triton.llm.sampling import RasSampler, make_generator, ras_sample

NUM_TOKENS = 30


def greedy_sampler(logp: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
    """Argmax; ignores history and generator: deterministic decoding for tests (test_golden uses it too)."""
    return int(logp.argmax())


@pytest.fixture(scope="module")
def model(golden_model_dir: Path) -> SpeechLM:
    return SpeechLM.from_model_dir(golden_model_dir, max_batch=2, max_seq_len=128)


def random_request(model: SpeechLM, seed: int, text_len: int, prompt_text_len: int,
                   prompt_speech_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    vocab, speech = model.config.qwen.vocab_size, model.config.speech_token_size
    return (torch.randint(vocab, (1, text_len), generator=rng),
            torch.randint(vocab, (1, prompt_text_len), generator=rng),
            torch.randint(speech, (1, prompt_speech_len), generator=rng))


def sample_tokens(model: SpeechLM, request: tuple, seed: int, slot: int = 0) -> list[int]:
    stream = generate(model, *request, sampling=SamplingParams(seed=seed), slot=slot)
    return list(islice(stream, NUM_TOKENS))


def test_seeded_sampling_is_reproducible_and_seed_dependent(model: SpeechLM) -> None:
    request = random_request(model, 0, text_len=5, prompt_text_len=3, prompt_speech_len=7)
    first = sample_tokens(model, request, seed=11)
    assert len(first) == NUM_TOKENS
    assert sample_tokens(model, request, seed=11, slot=1) == first
    assert sample_tokens(model, request, seed=12) != first


def test_interleaved_requests_do_not_disturb_each_other(model: SpeechLM) -> None:
    request_a = random_request(model, 1, text_len=4, prompt_text_len=2, prompt_speech_len=5)
    request_b = random_request(model, 2, text_len=6, prompt_text_len=0, prompt_speech_len=0)
    alone_a, alone_b = sample_tokens(model, request_a, seed=3), sample_tokens(model, request_b, seed=4)
    stream_a = generate(model, *request_a, sampling=SamplingParams(seed=3), slot=0)
    stream_b = generate(model, *request_b, sampling=SamplingParams(seed=4), slot=1)
    together = [(next(stream_a), next(stream_b)) for _ in range(NUM_TOKENS)]
    assert [a for a, _ in together] == alone_a
    assert [b for _, b in together] == alone_b


def decode_alone(model: SpeechLM, prompt: torch.Tensor, forced: torch.Tensor, slot: int) -> torch.Tensor:
    """Prefill `prompt` (1, L, D) into `slot`, then feed `forced` (1, N) one step at a time -> (N + 1, V)."""
    slots, length = torch.tensor([slot]), prompt.shape[1]
    rows = [model.step_logits(prompt, torch.arange(length)[None], slots)]
    for k in range(forced.shape[1]):
        rows.append(model.step_logits(model.embed_speech(forced[:, k:k + 1]), torch.tensor([[length + k]]), slots))
    return torch.cat(rows)


def test_batched_decode_equals_solo(model: SpeechLM) -> None:
    """Two streams of different prompt lengths, decoded together in one batch, match their solo runs."""
    short, long = (model.build_prompt(*random_request(model, seed, 4 + seed, 2 * seed, 3 * seed)) for seed in (1, 3))
    assert short.shape[1] < long.shape[1]
    forced = torch.randint(model.config.speech_token_size, (2, 6), generator=torch.Generator().manual_seed(5))
    # Solo runs, both in slot 0; the long one goes last and leaves stale entries past the short prompt.
    solo_short = decode_alone(model, short, forced[:1], slot=0)
    solo_long = decode_alone(model, long, forced[1:], slot=0)
    for prompt, tokens, solo in ((short, forced[:1], solo_short), (long, forced[1:], solo_long)):
        oneshot = model.logits_full(torch.cat([prompt, model.embed_speech(tokens)], dim=1))[0]  # (L + N, V)
        torch.testing.assert_close(solo, oneshot[prompt.shape[1] - 1:], rtol=0, atol=1e-5)
    # Batch rows [long, short] live in slots [1, 0]: the row index is not the slot index.
    first_long = model.step_logits(long, torch.arange(long.shape[1])[None], torch.tensor([1]))
    first_short = model.step_logits(short, torch.arange(short.shape[1])[None], torch.tensor([0]))
    rows_long, rows_short = [first_long[0]], [first_short[0]]
    slots = torch.tensor([1, 0])
    positions = torch.tensor([[long.shape[1]], [short.shape[1]]])  # (2, 1)
    for k in range(forced.shape[1]):
        step_tokens = torch.stack([forced[1, k:k + 1], forced[0, k:k + 1]])  # (2, 1) in row order
        logits = model.step_logits(model.embed_speech(step_tokens), positions + k, slots)  # (2, V)
        rows_long.append(logits[0])
        rows_short.append(logits[1])
    torch.testing.assert_close(torch.stack(rows_long), solo_long, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.stack(rows_short), solo_short, rtol=0, atol=1e-5)


def test_eos_is_masked_until_min_len_and_stop_tokens_end_the_stream(model: SpeechLM) -> None:
    request = random_request(model, 4, text_len=2, prompt_text_len=1, prompt_speech_len=2)
    min_len, _ = model.length_limits(request[0].shape[1])
    eos_logp: list[float] = []
    stop_at = min_len + 2

    def recording_sampler(logp: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None) -> int:
        eos_logp.append(float(logp[model.config.eos_token]))
        return model.config.stop_tokens[-1] if len(decoded) == stop_at else greedy_sampler(logp, decoded, generator)

    tokens = list(generate(model, *request, sampler=recording_sampler))
    assert len(tokens) == stop_at
    assert all(t not in model.config.stop_tokens for t in tokens)
    assert all(v == -math.inf for v in eos_logp[:min_len])
    assert all(math.isfinite(v) for v in eos_logp[min_len:])


def test_cross_lingual_layout_with_empty_prompts(model: SpeechLM) -> None:
    text, empty_text, empty_speech = random_request(model, 5, text_len=3, prompt_text_len=0, prompt_speech_len=0)
    lm_input = model.build_prompt(text, empty_text, empty_speech)
    assert lm_input.shape == (1, text.shape[1] + 2, model.config.llm_input_size)


def test_ras_bans_a_recent_repeat() -> None:
    logp = torch.full((50,), -20.0)
    logp[7] = 0.0  # nearly all the mass: the nucleus is token 7 alone
    logp = logp.log_softmax(dim=0)
    sampler = RasSampler(SamplingParams())
    generator = make_generator(0)
    assert sampler(logp, [], generator) == 7
    assert sampler(logp, [7, 1, 2], generator) != 7
    assert sampler(logp, [7] + [1] * 10, generator) == 7  # 7 has left the window of 10


def test_nucleus_respects_top_k() -> None:
    logp = torch.linspace(0.0, -0.5, 40).log_softmax(dim=0)  # sorted: the three best are ids 0, 1, 2
    sampler = RasSampler(SamplingParams(top_p=1.0, top_k=3, tau_r=2.0))  # tau_r > 1: never resample
    generator = make_generator(1)
    assert {sampler(logp, [], generator) for _ in range(50)} == {0, 1, 2}


def reference_ras(logp: torch.Tensor, decoded: Sequence[int], generator: torch.Generator | None,
                  params: SamplingParams) -> tuple[int, int | None]:
    """Repetition-aware sampling as the official `ras_sampling` at the golden set's commit does it, written
    out independently. Returns the token and, when it was redrawn, the banned first draw.

    Nucleus: walk the probabilities in stable descending order, keeping each while the float32 running sum
    of the kept ones is below top_p and fewer than top_k are kept; draw one of them in proportion to its
    probability. If the drawn token occurs at least win_size * tau_r times among the last win_size decoded
    tokens, set its score to -inf and draw again from the softmax of all scores. (The ban arrived with
    upstream commit f2ddcbe "fix ras", an ancestor of the pinned ace7c47; earlier versions redrew from the
    full distribution, repeated token included.)
    """
    probs, order = logp.softmax(dim=0).sort(descending=True, stable=True)
    kept_probs, kept_ids = [], []
    running = torch.zeros((), dtype=probs.dtype)
    for prob, token_id in zip(probs, order):
        if not (running < params.top_p and len(kept_probs) < params.top_k):
            break
        running = running + prob
        kept_probs.append(prob)
        kept_ids.append(int(token_id))
    token = kept_ids[int(torch.stack(kept_probs).multinomial(1, replacement=True, generator=generator))]
    repeats = sum(1 for previous in decoded[-params.win_size:] if previous == token)
    if repeats < params.win_size * params.tau_r:
        return token, None
    scores = logp.clone()
    scores[token] = -math.inf
    return int(scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator)), token


def random_logp(rng: torch.Generator, preference: torch.Tensor, step: int) -> torch.Tensor:
    """Log-probs (V,) of varied shapes, flat to peaked, around a fixed `preference` (V,) so that the same
    tokens keep winning and repeats occur; some with ties (coarse logits) or an EOS-like -inf."""
    vocab = preference.shape[0]
    scale = float(torch.empty(()).uniform_(0.3, 8.0, generator=rng))
    logits = (preference + torch.randn(vocab, generator=rng)) * scale
    if step % 3 == 0:
        logits = (logits * 2).round() / 2  # many equal scores: the stable sort decides their order
    if step % 5 == 0:
        logits[int(torch.randint(vocab, (), generator=rng))] = -math.inf
    return logits.log_softmax(dim=0)


@pytest.mark.parametrize("params", [
    SamplingParams(),  # the released values
    SamplingParams(top_p=0.95, top_k=5, win_size=4, tau_r=0.5),
    SamplingParams(top_p=1.0, top_k=100, win_size=20, tau_r=0.2),
    SamplingParams(top_p=0.3, top_k=25, win_size=3, tau_r=1.0),
], ids=["released", "narrow", "wide", "short_window"])
def test_ras_matches_the_official_algorithm_draw_for_draw(params: SamplingParams) -> None:
    """Many steps of autoregressive sampling: the same tokens and the same number of draws as the
    reference; and the reference with its own generator gives what the official global-RNG code gives."""
    vocab, steps, seed = 48, 300, 1234
    rng = torch.Generator().manual_seed(params.top_k)
    preference = torch.randn(vocab, generator=rng)
    logps = [random_logp(rng, preference, step) for step in range(steps)]
    prefix = torch.randint(vocab, (params.win_size,), generator=rng).tolist()  # a history to start from

    sampler, ours, reference = RasSampler(params), make_generator(seed), torch.Generator().manual_seed(seed)
    decoded, resampled = list(prefix), 0
    for step, logp in enumerate(logps):
        token = sampler(logp, decoded, ours)
        expected, banned = reference_ras(logp, decoded, reference, params)
        assert token == expected, f"step {step}"
        if banned is not None:
            resampled += 1
            assert token != banned
        decoded.append(token)
    assert torch.equal(ours.get_state(), reference.get_state())
    assert 0 < resampled < steps  # both branches ran

    with torch.random.fork_rng(devices=[]):  # the official code draws from the global CPU generator
        torch.manual_seed(seed)
        official = list(prefix)
        for logp in logps:
            official.append(reference_ras(logp, official, None, params)[0])
    assert official == decoded


def test_torch_draws_one_multinomial_sample_as_argmax_over_exponential_noise() -> None:
    """What `ras_sample` relies on to draw a batch with per-row generators: for one sample,
    torch.multinomial(p, 1, replacement=True, generator=g) is argmax(p / q), q = empty_like(p).exponential_(1, g),
    a draw and a generator state that depend on len(p); filling a row slice of a wider tensor gives the same."""
    rng = torch.Generator().manual_seed(0)
    for size in (1, 2, 7, 25, 300):
        for seed in range(20):
            probs = torch.rand(size, generator=rng) ** 4
            if seed % 3 == 0:
                probs[1::2] = 0.0  # zeros among the candidates
            ours, theirs = make_generator(seed), make_generator(seed)
            for _ in range(3):
                expected = int(torch.multinomial(probs, 1, replacement=True, generator=theirs))
                noise = torch.ones(3, size + 4)
                noise[1, :size].exponential_(1, generator=ours)
                assert int((probs / noise[1, :size]).argmax()) == expected
            assert torch.equal(ours.get_state(), theirs.get_state())


BATCH_PARAMS = [SamplingParams(), SamplingParams(top_p=0.95, top_k=5, win_size=4, tau_r=0.5),
                SamplingParams(top_p=1.0, top_k=100, win_size=20, tau_r=0.2),
                SamplingParams(top_p=0.3, top_k=25, win_size=3, tau_r=1.0), SamplingParams(top_p=0.6, top_k=1),
                SamplingParams(top_p=1.0, top_k=1000, win_size=6, tau_r=0.34)]  # top_k above the vocabulary


@pytest.mark.parametrize("batch", range(1, 9))
def test_a_batched_draw_equals_each_row_drawn_alone(batch: int) -> None:
    """Rows of mixed params, histories and seeds, some with EOS banned, drawn together for many steps: each
    row's tokens and generator state equal those of RasSampler alone and of the official algorithm."""
    vocab, steps, eos = 48, 40, 47
    rng = torch.Generator().manual_seed(100 + batch)
    params = [BATCH_PARAMS[(batch + b) % len(BATCH_PARAMS)] for b in range(batch)]
    seeds = torch.randint(2**32, (batch,), generator=rng).tolist()
    preference = torch.randn(vocab, generator=rng)
    # Each window full of one token, which the first step all but forces: a re-draw on every row at step 0,
    # whatever the random log-probs after it do (they differ between CPU kinds' randn kernels).
    hot = 3
    histories = [[hot] * p.win_size for p in params]
    together, alone, reference = ([make_generator(seed) for seed in seeds] for _ in range(3))
    alone_histories = [list(history) for history in histories]
    resampled = 0
    for step in range(steps):
        logp = torch.stack([random_logp(rng, preference, step + b) for b in range(batch)])  # (B, V)
        if step == 0:
            logp = torch.full((batch, vocab), -30.0).index_fill_(1, torch.tensor([hot]), 0.0).log_softmax(dim=1)
        short = [b for b in range(batch) if (step + b) % 4 != 0]  # below min_len: EOS banned
        logp[short, eos] = -math.inf
        tokens = ras_sample(logp.clone(), params, histories, together)
        for b in range(batch):
            expected, banned = reference_ras(logp[b], histories[b], reference[b], params[b])
            assert tokens[b] == expected, f"step {step}, row {b}"
            assert RasSampler(params[b])(logp[b].clone(), alone_histories[b], alone[b]) == expected
            assert b not in short or tokens[b] != eos
            resampled += banned is not None
            histories[b].append(expected)
            alone_histories[b].append(expected)
    for generators in (together, alone):
        assert all(torch.equal(g.get_state(), r.get_state()) for g, r in zip(generators, reference))
    assert resampled >= batch  # the re-draw ran (on every row at step 0)


def test_a_row_without_a_distribution_fails_alone() -> None:
    """A NaN row and a row whose re-draw has nothing left each get an exception; their neighbours draw as
    alone, and the NaN row's generator is untouched (torch.multinomial checks before it draws)."""
    vocab, params = 50, SamplingParams()
    rng = torch.Generator().manual_seed(3)
    logp = torch.randn(4, vocab, generator=rng).log_softmax(dim=-1)  # (4, V)
    logp[1] = math.nan
    logp[2] = -math.inf
    logp[2, 7] = 0.0  # one token only, and it repeats: the re-draw bans it and finds nothing
    histories = [[], [], [7] * 10, [1, 2]]
    generators = [make_generator(seed) for seed in range(4)]
    tokens = ras_sample(logp.clone(), [params] * 4, histories, generators)
    assert isinstance(tokens[1], Exception) and isinstance(tokens[2], Exception)
    assert torch.equal(generators[1].get_state(), make_generator(1).get_state())
    for b in (0, 3):
        assert tokens[b] == RasSampler(params)(logp[b].clone(), histories[b], make_generator(b))
    with pytest.raises(RuntimeError):
        RasSampler(params)(logp[2].clone(), histories[2], make_generator(2))


@pytest.mark.parametrize("field, value", [
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", 0), ("top_k", 2.5),
    ("win_size", 0), ("tau_r", -0.1), ("seed", -1), ("seed", 2**64), ("seed", True),
])
def test_invalid_sampling_params(field: str, value: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        SamplingParams(**{field: value}).validate()
    assert caught.value.field == field


def test_sampling_defaults_come_from_the_yaml(model: SpeechLM, golden_model_dir: Path) -> None:
    sampling = read_yaml(golden_model_dir / "cosyvoice2.yaml")["llm"]["sampling"]
    fields = ("top_p", "top_k", "win_size", "tau_r")
    assert {name: getattr(model.config.sampling, name) for name in fields} == {name: sampling[name] for name in fields}
