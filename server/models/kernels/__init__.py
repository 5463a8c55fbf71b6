"""The model's kernels: ctypes bindings of the CPU C kernels (linear, the layer's other ops,
attention) and the CuPy binding of the CUDA paged decode attention, each beside a pure-torch
reference of the same signature. Their sources are in src/; the cache's own transfer kernels
are `hicache.kernels`."""
