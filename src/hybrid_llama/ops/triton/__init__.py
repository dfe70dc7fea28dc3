"""The CUDA kernels (Triton): the parallel op and the decode step, imported lazily by ``ops.dispatch``."""
