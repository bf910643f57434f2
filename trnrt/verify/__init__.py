"""Verification tools: `trnrt verify graph-equiv` (canonical graph identity against lock files)."""
