"""gpupool collectors."""
