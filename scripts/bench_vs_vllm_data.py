"""The text datasets scripts/bench-vs-vllm.sh sends (vLLM's custom dataset format: {"prompt": ...}
per line), cut from the docstrings of Python's standard library (natural English, on every
machine); one file of each per RUN in RUN_SETS (warmup and the scored runs 0, 1, 2, from the
modules' docstrings) and TUNE_SET (the vLLM sweep's tuning pass, from the docstrings of their
public classes and functions), none sharing a prompt or a preamble with another, so a run
never hits what an earlier run left in a server's prefix cache, and the sweep tunes on other
text than it is scored on:
  WORK/single_text.RUN.jsonl: 8 text prompts of 390-540 tokens (by the model's tokenizer)
  WORK/chat_prefix.RUN.jsonl: one shared ~400-token system preamble, then 64 distinct questions
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import sys

SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}


def _paragraphs(doc: str | None) -> list[str]:
    return [" ".join(p.split()) for p in (doc or "").split("\n\n") if len(p) > 200]


def _stdlib_text(api: bool = False) -> list[str]:
    """Paragraphs of the standard library's module docstrings (api: of the modules' public
    classes and functions instead), in a fixed order."""
    paras = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:   # noqa: BLE001 - any module that does not import is skipped
            continue
        if not api:
            paras += _paragraphs(mod.__doc__)
            continue
        for key, obj in sorted(vars(mod).items()):
            if (not key.startswith("_") and getattr(obj, "__module__", None) == name
                    and (inspect.isclass(obj) or inspect.isfunction(obj))):
                paras += _paragraphs(inspect.getdoc(obj))
    return paras


RUN_SETS = ("warmup", "0", "1", "2")
TUNE_SET = "tune"
SINGLE_PER_RUN = 8


def _write_sets(tok, paras: list[str], run_sets: tuple[str, ...], work: str) -> None:
    """Each run set's single-stream prompts and chat preamble, from shuffled paragraphs."""
    rng = random.Random(0)
    paras = list(paras)
    rng.shuffle(paras)
    want = SINGLE_PER_RUN * len(run_sets)
    prompts, cur, used = [], "", 0
    for p in paras:
        used += 1
        cur = f"{cur}\n\n{p}" if cur else p
        n = len(tok(cur)["input_ids"])
        if n > 540:
            cur = ""
        elif n >= 390:
            prompts.append(cur + "\n\nSummarize the text above in plain words.")
            cur = ""
        if len(prompts) == want:
            break
    assert len(prompts) == want, \
        f"{len(prompts)} single-stream prompts from the standard library's text, {want} wanted"
    for i, run in enumerate(run_sets):
        with open(os.path.join(work, f"single_text.{run}.jsonl"), "w") as f:
            for p in prompts[i * SINGLE_PER_RUN:(i + 1) * SINGLE_PER_RUN]:
                f.write(json.dumps({"prompt": p}) + "\n")
    questions = [f"Question {k}: in two sentences, what does the note about '{w}' say?"
                 for k, w in enumerate(" ".join(paras[:40]).split()[::37][:64])]
    spare = paras[used:][::-1]          # paragraphs no single-stream prompt took
    for run in run_sets:                # each run its own preamble
        preamble = ""
        while len(tok(preamble)["input_ids"]) < 400:
            assert spare, "not enough standard-library text for the chat preambles"
            preamble = f"{preamble} {spare.pop(0)}".strip()
        preamble = ("You are a support assistant for a Python team. Reference notes follow; "
                    "answer from them.\n\n" + preamble)
        with open(os.path.join(work, f"chat_prefix.{run}.jsonl"), "w") as f:
            for q in questions:
                f.write(json.dumps({"prompt": f"{preamble}\n\n{q}"}) + "\n")


def make_data(hf_dir: str, work: str) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    _write_sets(tok, _stdlib_text(), RUN_SETS, work)
    _write_sets(tok, _stdlib_text(api=True), (TUNE_SET,), work)
