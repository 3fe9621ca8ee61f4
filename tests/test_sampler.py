"""The batched sampler (workers/sampler.py): its draws follow softmax(logits / T) restricted by
top-k, top-p and blocked ids; a seeded request's tokens do not depend on its batch."""

from __future__ import annotations

from dataclasses import replace

import torch

from protocol.sampling import SamplingParams
from workers.sampler import sample


class _Req:
    """What the sampler reads of a request."""

    def __init__(self, sp: SamplingParams, outputs: int = 0, eos: tuple[int, ...] = ()) -> None:
        self.sampling, self.output_token_ids, self.eos_token_ids = sp, [0] * outputs, eos
        self.generator = None


def _counts(logits: torch.Tensor, sp: SamplingParams, draws: int, batch: int = 8) -> torch.Tensor:
    """Token counts of `draws` draws of one row of logits, `batch` rows a call."""
    counts = torch.zeros(logits.shape[-1])
    reqs = [_Req(replace(sp, seed=sp.seed + i)) for i in range(batch)]   # one stream each
    for _ in range(draws // batch):
        for tok in sample(logits.expand(batch, -1), reqs):   # type: ignore[arg-type]
            counts[tok] += 1
    return counts


def test_draws_follow_the_tempered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    for temperature in (0.5, 1.0, 2.0):
        draws = 16_000
        counts = _counts(logits, SamplingParams(temperature=temperature, seed=7), draws)
        p = torch.softmax(logits[0] / temperature, dim=-1)
        expected = p * draws
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 40.0, (temperature, chi2)     # 11 dof: p < 1e-4 for a correct sampler


def test_top_k_and_top_p_keep_only_their_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    top2 = _counts(logits, SamplingParams(temperature=1.0, seed=1, top_k=2), 800)
    assert set(top2.nonzero().flatten().tolist()) == {0, 1}
    # softmax: 0.64, 0.23, 0.086, ... top_p 0.8 keeps the first token over 0.8: ids 0 and 1
    nucleus = _counts(logits, SamplingParams(temperature=1.0, seed=2, top_p=0.8), 800)
    assert set(nucleus.nonzero().flatten().tolist()) == {0, 1}
    # both: top-k then top-p over what is left
    both = _counts(logits, SamplingParams(temperature=1.0, seed=3, top_k=3, top_p=0.5), 400)
    assert set(both.nonzero().flatten().tolist()) == {0}


def test_blocked_ids_are_never_drawn_before_min_tokens():
    logits = torch.tensor([[5.0, 5.0, -2.0, -2.0]])
    sp = SamplingParams(temperature=1.0, seed=4, min_tokens=3, stop_token_ids=(1,))
    reqs = [_Req(sp, outputs=1, eos=(0,)) for _ in range(8)]
    seen = set()
    for _ in range(50):
        seen.update(sample(logits.expand(8, -1), reqs))  # type: ignore[arg-type]
    assert seen == {2, 3}
    late = [_Req(sp, outputs=3, eos=(0,)) for _ in range(8)]     # min_tokens reached
    assert set(sample(logits.expand(8, -1), late)) <= {0, 1, 2, 3}  # type: ignore[arg-type]
    assert {0, 1} & set(sum((sample(logits.expand(8, -1), late)  # type: ignore[arg-type]
                             for _ in range(20)), []))


def test_a_seeded_request_draws_the_same_tokens_whatever_its_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 300) * 3
    sp = SamplingParams(temperature=0.8, seed=1234, top_k=50)
    alone, batched = _Req(sp), _Req(sp)
    others = [_Req(SamplingParams(temperature=1.3)), _Req(SamplingParams(temperature=0.0)),
              _Req(SamplingParams(temperature=0.6, seed=9, top_p=0.9))]
    a, b = [], []
    for step in range(20):
        a += sample(logits[step % 6: step % 6 + 1], [alone])      # type: ignore[list-item]
        rows = torch.stack([logits[(step + 1) % 6], logits[step % 6],
                            logits[(step + 2) % 6], logits[(step + 3) % 6]])
        b.append(sample(rows, [others[0], batched, others[1], others[2]])[1])  # type: ignore
    assert a == b
    assert len(set(a)) > 1            # it did sample, not argmax


def test_greedy_rows_beside_sampled_rows_stay_argmax():
    torch.manual_seed(2)
    logits = torch.randn(4, 1000)
    reqs = [_Req(SamplingParams(temperature=0.0)), _Req(SamplingParams(temperature=1.0)),
            _Req(SamplingParams(temperature=1e-7)), _Req(SamplingParams(temperature=2.0))]
    out = sample(logits, reqs)        # type: ignore[arg-type]
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert all(0 <= t < 1000 for t in out)


def test_bf16_logits_and_a_tiny_temperature():
    torch.manual_seed(3)
    logits = torch.randn(3, 49_152) * 4
    logits[:, 123] += 40                      # one best token a row (bf16 rounds ties in)
    logits = logits.to(torch.bfloat16)
    reqs = [_Req(SamplingParams(temperature=1e-5, seed=i)) for i in range(3)]
    # 1e-5 samples (>= GREEDY_BELOW) but every token but the best weighs exp(-huge) = 0
    assert sample(logits, reqs) == logits.float().argmax(-1).tolist()  # type: ignore[arg-type]
