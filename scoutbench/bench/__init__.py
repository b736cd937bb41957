"""Measuring decode speed: one throughput run (throughput), grids of them (sweep, executors), the per-layer recall
profile (recall), the selection's cosine to full attention (cosine) and the work model's coefficients (calibration).
Built on the engine, the methods and the analysis of results."""
