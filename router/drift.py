"""Hash drift alarm: the router's predicted prefix hit per request against the hit the engine
reports. When the router predicts more than the engines find, over a window, the router's block
hashes no longer match the workers' (another tokenizer, chat template, namespace or block size):
routing by locality is then blind while looking fine (the silent 0% hits of vLLM / llm-d /
SGLang reports). The alarm raises a flag, a counter, and logs one warning per episode."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("raypd.router.drift")


@dataclass(frozen=True)
class DriftStatus:
    alarm: bool
    window: int                # requests in the window
    predicted_tokens: int      # sum of predicted hit tokens over the window
    real_tokens: int           # sum of engine-reported hit tokens
    shortfall_ratio: float     # (predicted - real) / predicted (0 when nothing predicted)
    episodes: int              # times the alarm went on


class HashDriftAlarm:
    """On when, over the last `window` requests with a predicted hit (at least `min_samples`),
    (predicted - real) / predicted exceeds `margin`; off again below margin / 2."""

    def __init__(self, window: int = 64, margin: float = 0.25, min_samples: int = 16,
                 on_alarm=None) -> None:
        assert 0 < margin < 1 and window >= min_samples >= 1
        self.margin = margin
        self.min_samples = min_samples
        self._samples: deque[tuple[int, int]] = deque(maxlen=window)
        self.alarm = False
        self.episodes = 0
        self.observed = 0
        self.on_alarm = on_alarm

    def observe(self, predicted_tokens: int, real_tokens: int) -> bool:
        """One finished prefill: predicted hit (router) vs real hit (engine), in tokens.
        Returns whether the alarm is on afterwards."""
        self.observed += 1
        if predicted_tokens <= 0:
            return self.alarm             # nothing predicted: nothing to drift from
        self._samples.append((predicted_tokens, real_tokens))
        st = self.status()
        if not self.alarm and st.window >= self.min_samples and st.shortfall_ratio > self.margin:
            self.alarm = True
            self.episodes += 1
            log.warning("hash drift: the router predicted %d prefix-hit tokens over the last %d "
                        "requests, the engines found %d (%.0f%% short): the router's block "
                        "hashes likely differ from the workers' (tokenizer, chat template, "
                        "namespace, block size)", st.predicted_tokens, st.window,
                        st.real_tokens, 100 * st.shortfall_ratio)
            if self.on_alarm is not None:
                self.on_alarm(self.status())
        elif self.alarm and st.shortfall_ratio < self.margin / 2:
            self.alarm = False
        return self.alarm

    def status(self) -> DriftStatus:
        pred = sum(p for p, _ in self._samples)
        real = sum(min(r, p) for p, r in self._samples)
        return DriftStatus(self.alarm, len(self._samples), pred, real,
                           (pred - real) / pred if pred else 0.0, self.episodes)
