"""Placeholder; filled by its issue."""
