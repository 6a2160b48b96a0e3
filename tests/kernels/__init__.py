"""Tests of the Triton kernels (draftforge.kernels) against their PyTorch references."""
