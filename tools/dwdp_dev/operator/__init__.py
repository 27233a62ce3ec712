"""Test helpers of the operator: a stand-in rank program (no model, no torch)."""
