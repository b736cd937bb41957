"""Measuring accuracy: greedy generation through a method (generation), the LongBench and passkey runs and their
resumable predictions (accuracy), the official scoring of prediction files (score) and the method-vs-FullKV
agreement check (fidelity). Built on the engine, the methods and the workloads."""
