"""One-command pipelines (.sh) and the builders they run: SmolLM2 drafters, EESD, C2T, hybrids."""
