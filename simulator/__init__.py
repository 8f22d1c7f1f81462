"""gpupool simulator."""
