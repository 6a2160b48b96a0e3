"""Kernels: each op is a Triton kernel plus a pure-PyTorch `<op>_ref` twin (the spec)."""
