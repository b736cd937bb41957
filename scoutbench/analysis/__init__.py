"""Reading results, never running a model: the regression gates (gate, counter_gate), the tables and figures
(report), the work model (work) and the paper-scale projection built on it (projection), and the export of results
to CSV, MLflow and Weights & Biases (export, loggers)."""
