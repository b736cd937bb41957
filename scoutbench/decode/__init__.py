"""The decode path: `DecodeEngine`'s layer loop (engine.py), the model work around attention in its three forms
(ops.py) and the piecewise CUDA graphs of a decode step (graphs.py). Imported by module, never from here, so that
importing the package loads no torch."""
