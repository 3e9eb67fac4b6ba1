"""The batched sampler (llm/sampling.py, `ras_sample_table`): every row's draw in tensor ops, its twister
state in a GeneratorTable, and the same tokens as today's sampler (`ras_sample`, per-row torch generators)
for a seed, draw for draw, over many steps, seeds, settings, joins and leaves."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cosyvoice_triton.messages import SamplingParams
from cosyvoice_triton.llm.sampling import GeneratorTable, make_generator, ras_sample, ras_sample_table

SETTINGS = [SamplingParams(), SamplingParams(top_p=0.95, top_k=5, win_size=4, tau_r=0.5),
            SamplingParams(top_p=1.0, top_k=100, win_size=20, tau_r=0.2),
            SamplingParams(top_p=0.3, top_k=25, win_size=3, tau_r=1.0), SamplingParams(top_p=0.6, top_k=1),
            SamplingParams(top_p=1.0, top_k=400, win_size=6, tau_r=0.34),  # 800 words a draw: a twist inside
            SamplingParams(top_p=1.0, top_k=10_000, win_size=1, tau_r=0.0)]  # above the vocabulary; always re-draws


def test_the_table_draws_exponential_noise_as_torch_does() -> None:
    """Per row, the numbers and the generator state of `torch.empty(n).exponential_(1, generator)`, for draws
    of every length, crossing the twister's 624-word arrays, with some rows drawing nothing."""
    seeds = [0, 1, 7, 2**32 - 1, 2**40 + 3, 2**63]
    table = GeneratorTable(len(seeds) + 2)
    slots = torch.arange(2, len(seeds) + 2)
    references = [make_generator(seed) for seed in seeds]
    for slot, seed in zip(slots.tolist(), seeds):
        table.load(slot, make_generator(seed), win_size=10)
    rng = np.random.default_rng(0)
    for step in range(200):
        counts = rng.integers(0, 40, len(seeds))
        counts[step % len(seeds)] = rng.integers(0, 1500) if step % 7 == 0 else 0
        noise = table.exponential(slots, torch.as_tensor(counts), max(1, int(counts.max())))
        for b, generator in enumerate(references):
            expected = torch.empty(int(counts[b])).exponential_(1, generator=generator)
            assert torch.equal(noise[b, :counts[b]], expected), f"step {step}, row {b}"
            assert (noise[b, counts[b]:] == 1).all()
    for slot, reference, seed in zip(slots.tolist(), references, seeds):
        generator = make_generator(seed)  # store() keeps the generator's own seed record
        table.store(slot, generator)
        assert torch.equal(generator.get_state(), reference.get_state())
        assert float(torch.rand((), generator=generator)) == float(torch.rand((), generator=reference))


def random_logp(rng: torch.Generator, preference: torch.Tensor, step: int) -> torch.Tensor:
    """Log-probs (V,): flat to peaked around `preference` (so repeats occur), some with ties or -inf."""
    vocab = preference.shape[0]
    scale = float(torch.empty(()).uniform_(0.3, 8.0, generator=rng))
    logits = (preference + torch.randn(vocab, generator=rng)) * scale
    if step % 3 == 0:
        logits = (logits * 2).round() / 2
    if step % 5 == 0:
        logits[int(torch.randint(vocab, (), generator=rng))] = -math.inf
    return logits.log_softmax(dim=0)


@pytest.mark.parametrize("vocab, slots, steps", [(48, 6, 150), (6564, 4, 30)])
def test_batched_tokens_equal_todays_for_every_seed(vocab: int, slots: int, steps: int) -> None:
    """Streams with mixed settings and seeds join free slots and leave at random; each round draws the
    live rows with `ras_sample_table` and with today's `ras_sample` (its own generators and histories):
    the same tokens every step, and the same generator state when a stream leaves."""
    rng = torch.Generator().manual_seed(vocab)
    draw = np.random.default_rng(vocab)
    preference = torch.randn(vocab, generator=rng)
    table = GeneratorTable(slots)
    live: dict[int, dict] = {}  # slot -> stream: params, today's generator and history
    redraws = compared = 0
    for step in range(steps):
        for slot in range(slots):
            if slot not in live and draw.random() < 0.5:  # a stream joins
                params = SETTINGS[int(draw.integers(len(SETTINGS)))]
                seed = int(draw.integers(2**63))
                table.load(slot, make_generator(seed), params.win_size)
                live[slot] = {"params": params, "generator": make_generator(seed), "history": [], "seed": seed}
        order = [slot for slot in live if draw.random() < 0.9]  # some sit a round out (a bistream's fill)
        if not order:
            continue
        draw.shuffle(order)
        logp = torch.stack([random_logp(rng, preference, step + slot) for slot in order])  # (B, V)
        logp[::3, vocab - 1] = -math.inf  # EOS banned in some rows
        params = [live[slot]["params"] for slot in order]
        ours = ras_sample_table(logp.clone(), params, table, order)
        today = ras_sample(logp.clone(), params, [live[slot]["history"] for slot in order],
                           [live[slot]["generator"] for slot in order])
        assert ours == today, f"step {step}"
        for slot, token, p in zip(order, today, params):
            history = live[slot]["history"]
            redraws += p.tau_r == 0 or list(history[-p.win_size:]).count(token) >= 1  # a re-draw, or near one
            history.append(token)
            compared += 1
        for slot in [slot for slot in live if draw.random() < 0.1]:  # a stream leaves
            generator = make_generator(live[slot]["seed"])
            table.store(slot, generator)
            assert torch.equal(generator.get_state(), live.pop(slot)["generator"].get_state())
    assert compared > steps and redraws > 0


def test_rows_without_a_distribution_fail_alone_as_today() -> None:
    """A NaN row draws nothing; a row whose re-draw has nothing left fails after its first draw; the
    neighbours' tokens and every generator state are today's."""
    vocab, params = 50, SamplingParams()
    logp = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)).log_softmax(dim=-1)  # (4, V)
    logp[1] = math.nan
    logp[2] = -math.inf
    logp[2, 7] = 0.0  # one token only, and it repeats: the re-draw bans it and finds nothing
    histories = [[], [], [7] * 10, [1, 2]]
    table = GeneratorTable(4)
    for slot in range(4):
        table.load(slot, make_generator(slot), params.win_size)
    for token in [7] * 10:  # slot 2's history
        table.push(torch.tensor([2]), torch.tensor([token]))
    table.push(torch.tensor([3, 3]), torch.tensor([1, 2]))
    ours = ras_sample_table(logp.clone(), [params] * 4, table, [0, 1, 2, 3])
    generators = [make_generator(slot) for slot in range(4)]
    today = ras_sample(logp.clone(), [params] * 4, histories, generators)
    assert [isinstance(t, Exception) for t in ours] == [isinstance(t, Exception) for t in today] \
        == [False, True, True, False]
    assert (ours[0], ours[3]) == (today[0], today[3])
    for slot in range(4):
        generator = make_generator(slot)
        table.store(slot, generator)
        assert torch.equal(generator.get_state(), generators[slot].get_state())


def test_a_table_refuses_a_gpu_generator_and_widens_for_a_longer_window() -> None:
    table = GeneratorTable(2)
    table.load(0, make_generator(1), win_size=3)
    table.push(torch.tensor([0]), torch.tensor([5]))
    table.load(1, make_generator(2), win_size=8)
    assert table.recent.shape == (2, 8) and table.recent[0, -1] == 5 and (table.recent[1] == -1).all()
    if torch.cuda.is_available():
        with pytest.raises(ValueError):
            table.load(0, torch.Generator(device="cuda"), win_size=3)
