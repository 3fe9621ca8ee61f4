"""What `raypd bench autoscale` asks of a machine, as multiples of the machine's own step times:
the workers' engine is calibrated here first (`raypd bench engine --calibration`'s probe, in a
Ray task placed as the workers are, at their thread count and step budget), and the SLOs and the
trace's rates follow from it, so a slow CPU kind gets a looser SLO and a lighter trace in the
same proportion as a fast one (the issue-60 Sapphire Rapids run met 14.7% of SLOs tuned on one
Zen machine).

  prefill step  = the idle TTFT: one request of the trace's longest prompt on an unloaded
                  1P:1D cluster, through the workers (prefill, KV handoff, first token;
                  median of a few after a warm-up); the engine's bare step is reported
                  beside it (`engine_prefill_step_s`: on the tiny model a fraction of a ms,
                  far below what any request through Ray can see)
  decode step   = the idle TPOT of those same requests (the engine's bare batch-1 step
                  beside it, `engine_decode_step_s`)
  TTFT SLO      = slo_ttft_x x prefill step      TPOT SLO = slo_tpot_x x decode step
  capacity      = requests/s one worker pair holds: min(decode tok/s at batch 16 / mean
                  output tokens, prefill tok/s / mean prompt tokens)
  burst rps     = burst_x x capacity             quiet rps = quiet_x x capacity

The multiples are a stated policy (4x the idle path leaves room for queueing under load; the
rates were chosen on one Zen 5 machine so that the burst needs more than one decode worker at
the TPOT SLO while the quiet phases need one of each); they are not derived."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Multiples:
    """The policy: SLOs and rates as multiples of the measured step times and capacity."""

    slo_ttft_x: float = 4.0      # x the idle TTFT of the longest prompt
    slo_tpot_x: float = 4.0      # x the idle TPOT
    burst_x: float = 0.25        # x one worker pair's request capacity
    quiet_x: float = 0.02

    def validate(self) -> None:
        for k, v in asdict(self).items():
            if not v > 0:
                raise ValueError(f"{k} must be > 0, got {v}")
        if self.quiet_x >= self.burst_x:
            raise ValueError(f"quiet_x ({self.quiet_x}) must be below burst_x "
                             f"({self.burst_x}): the trace is quiet, burst, quiet")


@dataclass(frozen=True)
class StepTimes:
    """The machine's figures the targets are multiples of (seconds, tokens/s)."""

    prefill_step_s: float        # idle TTFT of `prompt_tokens` through the workers
    decode_step_s: float         # idle TPOT through the workers
    engine_prefill_step_s: float   # the engine alone: one cold prefill of `prompt_tokens`
    engine_decode_step_s: float    # the engine alone: one decode step at batch 1
    prefill_tok_s: float
    decode_tok_s: float          # one worker's decode tokens/s at batch 16
    prompt_tokens: int
    threads: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class Targets:
    slo_ttft_s: float
    slo_tpot_s: float
    capacity_rps: float
    burst_rps: float
    quiet_rps: float


def derive(steps: StepTimes, m: Multiples, mean_prompt: float, mean_output: float) -> Targets:
    """The SLOs and rates of module doc from the measured step times."""
    assert steps.prefill_step_s > 0 and steps.decode_step_s > 0 and mean_output > 0
    capacity = min(steps.decode_tok_s / mean_output, steps.prefill_tok_s / max(1.0, mean_prompt))
    return Targets(slo_ttft_s=m.slo_ttft_x * steps.prefill_step_s,
                   slo_tpot_s=m.slo_tpot_x * steps.decode_step_s, capacity_rps=capacity,
                   burst_rps=m.burst_x * capacity, quiet_rps=m.quiet_x * capacity)


def _probe(model: str, dtype: str, threads: int, budget: int | None, prompt: int) -> dict:
    from raypd.bench.engine import run_calibration
    return run_calibration(model=model, threads=threads, dtype=dtype, repeats=5, device="cpu",
                           prefill_lens=(prompt,), prefill_batches=(),
                           decode_points=((1, prompt), (16, prompt)),
                           max_num_batched_tokens=budget)


def measure(engine: dict, prompt_tokens: int, threads: int, idle: tuple[float, float]
            ) -> tuple[StepTimes, dict]:
    """The step times of module doc: `idle` (TTFT, TPOT) measured through the workers by the
    caller; the engine's figures measured now in a Ray task placed as the workers are
    (num_cpus=0, `threads` torch threads, the workers' step budget); Ray must be up. Returns
    them with the probe's raw figures."""
    import ray
    raw = ray.get(ray.remote(num_cpus=0)(_probe).remote(   # None: the engine's CPU default
        engine.get("model", "tiny"), engine.get("dtype", "auto"), threads,
        engine.get("max_num_batched_tokens"), prompt_tokens))
    prefill_tok_s = raw["prefill_tok_s"][str(prompt_tokens)]
    b16 = raw["decode_step_ms_b16"] / 1e3
    return StepTimes(prefill_step_s=idle[0], decode_step_s=idle[1],
                     engine_prefill_step_s=prompt_tokens / prefill_tok_s,
                     engine_decode_step_s=raw["decode_step_ms_b1"] / 1e3,
                     prefill_tok_s=prefill_tok_s, decode_tok_s=16 / b16,
                     prompt_tokens=prompt_tokens, threads=threads,
                     max_num_batched_tokens=raw["max_num_batched_tokens"]), raw
