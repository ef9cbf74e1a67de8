"""Glue for other frameworks."""
