"""Array backends: numpy/cupy operations, DLPack in and out, CUDA staging."""
