"""Capture: an unmodified model and example inputs -> one canonical joint forward+backward ATen graph.

`trace.capture` (torch.export, then a functionalized joint trace on fake tensors), `stamp` (alike
layers traced once and stamped out), `cache` (one trace per model, inputs and options),
`trace_errors` (tracing failures as TraceErrors naming the user's line), `canonicalize` (addmm split,
per-phase parameter views), `dropout_masks` (masks kept as booleans), `precision` (bf16 autocast),
`moe_ops` / `moe_rewrite` (mixture-of-experts grouped matmuls).
"""
