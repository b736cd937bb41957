"""Reading results, never running a model: the regression gates (gate, counter_gate), the tables and figures
(report, figures), the work model (work) and the paper-scale projection built on it (projection, on the hardware
profiles of hardware), and the export of results to CSV, MLflow and Weights & Biases (export, loggers)."""
