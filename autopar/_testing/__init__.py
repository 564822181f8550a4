"""Shared test models and multi-process helpers for tests/ and benchmarks/ (not a public API).

`models` (tiny zoo models and real-size meta-device shapes), `gpt` (the example GPT), `dist_utils`
(spawning ranks with timeouts), `dist_cases` (train-and-compare helpers), `simulate` (virtual
ranks in one process), `fuzz_cases` (random configurations for the fuzz test).
"""
