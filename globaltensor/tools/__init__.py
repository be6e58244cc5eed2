"""Seeing what a program does: `comm_report` (each collective, by op and module), `explain` (the
layout each op chose and why) and `visualize` (which rank holds which block)."""
