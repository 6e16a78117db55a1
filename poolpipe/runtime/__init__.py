"""Serving runtime: where a plan's vGPUs live (placement)."""
