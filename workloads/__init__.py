"""Workloads (installed as `scoutbench.workloads`): one file each."""
