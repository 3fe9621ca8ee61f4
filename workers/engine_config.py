"""EngineConfig: one engine's settings (model, dtypes, KV pool, step budget, device), checked
by `validate()` before the engine is built.

Torch-free (the config loader, the router and `raypd serve`'s argument parsing import it), and
the one place the dtype names are listed: the YAML config (cluster/config.py), the command
lines and workers/device.py's torch dtypes all take them from here. Its defaults are the
`engine.*` / `model.*` defaults of the YAML config (cluster/config.py reads them from here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.kv_sizing import QUANTIZED_KV_DTYPES

WEIGHT_DTYPES = ("float32", "bfloat16")          # torch dtypes by name (workers/device.DTYPES)
DTYPES = ("auto", *WEIGHT_DTYPES)                # model weights (auto: by hardware)
KV_DTYPES = (*DTYPES, *QUANTIZED_KV_DTYPES)      # KV pool; int8 / fp8: workers/kv_quant.py
TP_ALLREDUCES = ("shm", "gloo")                  # workers/kernels/tp_comm.py


@dataclass
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"                 # model weights: auto | float32 | bfloat16
    kv_dtype: str = "auto"              # KV pool: auto (= model dtype) | float32 | bfloat16 |
                                        # int8 | fp8 (quantized, workers/kv_quant.py)
    block_size: int = 16
    num_blocks: int | None = None       # overrides kv_cache_gb
    kv_cache_gb: float = 1.0
    kv_tier2_gb: float = 0.0            # host tier for evicted blocks (0: off; workers/kv_tier2.py)
    kv_tier2_dir: str | None = None     # its memory-mapped file's folder (CPU pools; temp dir)
    max_num_batched_tokens: int | None = None   # tokens per step; None: by device
                                                # (protocol/step_rates.DEFAULT_BATCHED_TOKENS)
    max_step_ms: float | None = None    # TPOT target: mixed steps' prefill sized under it (off)
    max_num_seqs: int = 64
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None      # torch threads for this engine (per actor)
    seed: int = 0                       # for --model tiny weights
    model_impl: str = "auto"            # auto (compact where it applies) | compact | stock
    lora_adapters: dict[str, str] = field(default_factory=dict)   # name -> PEFT folder
    max_loras: int = 4                  # adapters resident at once (LRU beyond that)
    device: str = "auto"                # auto (cuda when this actor holds a GPU) | cpu | cuda
    cuda_graphs: bool = True            # cuda: replay decode steps of bucketed batch sizes
    tp: int = 1                         # tensor-parallel ranks (workers/tp_runner.py); 1: none
    tp_allreduce: str = "shm"           # TP all-reduce: shm (one host) | gloo

    def validate(self) -> None:
        from workers.device import DEVICES
        from workers.model_runner import MODEL_IMPLS
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, "
                             f"got {self.kv_dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.kv_tier2_gb < 0:
            raise ValueError(f"kv_tier2_gb must be >= 0, got {self.kv_tier2_gb}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0 (or None: off), got {self.max_step_ms}")
        if (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1
                or self.max_num_seqs < 1):
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, "
                             f"got {self.model_impl!r}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.tp < 1 or self.tp > 8:
            raise ValueError(f"tp must be between 1 and 8 ranks, got {self.tp}")
        if self.tp_allreduce not in TP_ALLREDUCES:
            raise ValueError(f"tp_allreduce must be one of {', '.join(TP_ALLREDUCES)}, "
                             f"got {self.tp_allreduce!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
