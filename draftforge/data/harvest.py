"""Moved to draftforge.harvest.c2t (kept for one release)."""
from draftforge.deprecation import moved_module
moved_module(__name__, "draftforge.harvest.c2t")
