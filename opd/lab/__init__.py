"""The tiny lab: a char tokenizer, a small Qwen3 model and its pre-training on capability mixes."""
