"""Embedded model assets."""
