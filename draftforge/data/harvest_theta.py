"""Moved to draftforge.harvest.cali_ts (kept for one release)."""
from draftforge.deprecation import moved_module
moved_module(__name__, "draftforge.harvest.cali_ts")
