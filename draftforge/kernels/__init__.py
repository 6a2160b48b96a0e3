"""Kernels: each tree op is a Triton kernel plus a pure-PyTorch `<op>_ref` twin (the spec); attention.py is the
float32 few-row attention of CPU decoding (pure PyTorch, faster there than torch's fused kernel)."""
