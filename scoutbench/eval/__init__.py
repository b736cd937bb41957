"""Measuring accuracy: greedy generation through a method (generation), the runs of the registered suites' tasks
(accuracy) with their resumable row files (predictions) and comparison tables (tables), the official scoring of
prediction files (score) and the method-vs-FullKV agreement check (fidelity). Built on the engine, the methods and
the workloads."""
