"""Moved to draftforge.harvest.logits (kept for one release)."""
from draftforge.deprecation import moved_module
moved_module(__name__, "draftforge.harvest.logits")
