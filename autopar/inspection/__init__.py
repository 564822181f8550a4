"""Inspection: reading plans. `summary` (str(plan), explain), `html` (a one-page report), `diff`
(what changed between two plans), `cli` (the `autopar` command)."""
