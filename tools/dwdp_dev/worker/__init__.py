"""Test and demo helpers of the worker: tiny seeded Hugging Face checkpoints, built offline."""
