"""The router's text work (frontend/): streamed text equals the final text in every case a
detokenizer gets wrong (stop strings split across tokens, multi-byte UTF-8 split across tokens,
special tokens skipped, include_stop_str_in_output), and a token costs the same at the end of a
long output as at its start (characters decoded counted)."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from frontend.detokenize import TextStream
from frontend.output_text import OutputText
from protocol.sampling import SamplingParams
from workers.model_loader import _tiny_tokenizer, resolve_model_dir


@pytest.fixture(scope="module")
def smol():
    return PreTrainedTokenizerFast.from_pretrained(resolve_model_dir("smollm2"))


def _stream(tok, ids: list[int], sampling: SamplingParams, step: int = 1):
    """(streamed text, final text, kept token ids) feeding `step` tokens at a time."""
    out = OutputText(tok, sampling)
    streamed = []
    for i in range(0, len(ids), step):
        streamed.append(out.add(ids[i:i + step]).text)
        if out.stopped:
            break
    streamed.append(out.finish())
    return "".join(streamed), out.text, out.token_ids


TEXT = ("Héllo wörld! 東京は日本の首都です。 Emoji: 🎉🚀 done. The quick brown fox jumps "
        "over the lazy dog, then naïve café owners say “bonjour” — twice.")


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_a_whole_decode_with_multibyte_characters_split(smol, step):
    ids = smol.encode(TEXT, add_special_tokens=False)
    # the emoji and CJK characters span several byte-level tokens: a split happens
    assert any("\ufffd" in smol.decode([t]) for t in ids)
    streamed, final, kept = _stream(smol, ids, SamplingParams(max_tokens=999), step)
    assert streamed == final == smol.decode(ids, skip_special_tokens=True) == TEXT
    assert kept == ids


def test_special_tokens_leave_no_text_and_can_be_kept(smol):
    body = smol.encode("Paris is the capital.", add_special_tokens=False)
    special = smol.all_special_ids[:2]
    ids = [special[0], *body[:3], special[1], *body[3:]]
    streamed, final, _ = _stream(smol, ids, SamplingParams(max_tokens=99))
    assert streamed == final == smol.decode(ids, skip_special_tokens=True)
    streamed, final, _ = _stream(smol, ids, SamplingParams(max_tokens=99,
                                                           skip_special_tokens=False))
    assert streamed == final == smol.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_split_across_tokens_is_never_streamed(smol, include):
    ids = smol.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    text = smol.decode(ids)
    stop = "ta gam"                    # spans the tokens of "beta" and " gamma"
    sp = SamplingParams(max_tokens=99, stop=("zzz", stop), include_stop_str_in_output=include)
    streamed, final, kept = _stream(smol, ids, sp)
    cut = text.find(stop) + (len(stop) if include else 0)
    assert streamed == final == text[:cut]
    # the tokens kept end with the one that completed the stop string
    assert smol.decode(kept).find(stop) >= 0 and stop not in smol.decode(kept[:-1])


def test_a_stop_string_counts_only_from_min_tokens(smol):
    ids = smol.encode("no no no yes", add_special_tokens=False)
    sp = SamplingParams(max_tokens=99, stop=("no",), min_tokens=3)
    streamed, final, kept = _stream(smol, ids, sp)
    # the first "no"s come before min_tokens: the stop is the first "no" after it
    assert streamed == final
    assert len(kept) >= 3 and final.count("no") >= 1


def test_the_tiny_byte_tokenizer_streams_a_split_utf8_character():
    tok = _tiny_tokenizer()
    ids = tok.encode("a€b", add_special_tokens=False)     # € is three byte tokens
    assert len(ids) == 5
    ts = TextStream(tok)
    parts = [ts.add([t]) for t in ids]
    assert parts == ["a", "", "", "€", "b"]


def test_a_tokens_cost_does_not_grow_with_the_output(smol):
    """A 4,000-token output made of one 100-token stretch of text 40 times: its last 100
    tokens cost no more characters decoded than its first 100 (a whole-output decode a token,
    the old way, costs ~40x more at the end)."""
    words = random.Random(0).choices(["river", "stone", "Über", "garden", "東京", "🎉", "quiet"],
                                     k=200)
    block = smol.encode(" " + " ".join(words), add_special_tokens=False)[:100]
    ids = block * 40
    ts = TextStream(smol, prompt=block)    # the prompt ends as the block does
    costs = []
    for t in ids:
        before = ts.chars_decoded
        ts.add([t])
        costs.append(ts.chars_decoded - before)
    assert sum(costs[-100:]) <= sum(costs[:100]), (sum(costs[:100]), sum(costs[-100:]))
    assert ts.text + ts.flush() == smol.decode(ids)
