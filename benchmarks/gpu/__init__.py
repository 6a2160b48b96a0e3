"""The GPU check: one command that proves draftforge's GPU path on a lent GPU machine (README.md here)."""
