"""gpupool broker."""
