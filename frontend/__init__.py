"""The text side of serving: prompts to token ids (chat template included) and output token ids
back to text, incrementally, with stop strings. The router runs it once per request, so the
engines see token ids only; an engine used on its own (`raypd generate`, tests) runs the same
code. Torch-free: it needs a tokenizer and nothing else."""
