"""gpupool analytics."""
