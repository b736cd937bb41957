"""Measuring decode speed: one throughput run, resolved (resolve) then measured (throughput), grids of them
(sweep_grid plans them, sweep runs and resumes them, executors), the per-layer recall profile (recall), the
selection's cosine to full attention (cosine) and the work model's coefficients (calibration). Built on the engine,
the methods and the analysis of results."""
