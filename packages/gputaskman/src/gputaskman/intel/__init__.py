"""Process and model intelligence: which runtime a process is, which model files it holds and
on what evidence, what a GGUF header, safetensors headers with a Hugging Face hub cache, and a
runtime's logs and API say about it, and the weights / KV cache / compute view built from
them.

May import: gputaskman.base.
"""
