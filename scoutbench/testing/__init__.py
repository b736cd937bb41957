"""Test machinery that ships inside the package, because the CLI uses it too: emulated CUDA on a CPU
(`SCOUTBENCH_EMULATE_CUDA=1`, the GPU check's dry run). Nothing below the CLI imports it (tests/project/test_layers.py).
"""
