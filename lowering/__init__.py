"""Inductor lowerings and graph passes for compiled_moe ops (installed as compiled_moe.lowering)."""
