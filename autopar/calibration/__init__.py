"""Calibration: `measure` times this machine's collectives and compute (`autopar calibrate`) and
writes a hardware profile; `fit` turns timings into alpha-beta and throughput figures."""
